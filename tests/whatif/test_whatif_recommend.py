"""The recommendation under --target, on results built with known numbers: the expected
choice is worked out here from the rule (meets the floor, then least memory, then most speed,
then best quality), never read back from the code."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from qforensics.cli import main
from qforensics.errors import UsageError
from qforensics.whatif.recommend import Target, parse_target, recommend
from qforensics.whatif.results import SchemeResult, WhatIfResult

NAN = math.nan


def _scheme(label, recovered, text_top1, mem=None, speed=None, vllm=None, error=None):
    s = SchemeResult(label, None, None, 1.0, 0.01, 10.0 / recovered if recovered else NAN,
                     text_top1, recovered, False, "t", 1.0, vllm=vllm, error=error)
    s.memory = None if mem is None else {"weight_bytes": int(mem * 1000), "stored_bytes": 0,
                                         "bf16_weight_bytes": 1000, "vs_bf16": mem}
    s.decode_speed_vs_bf16 = speed
    return s


def _result(*schemes):
    res = WhatIfResult(trace=None, prompt_source="p", salient_source="s", ref_text="t",
                       ref_ppl=10.0, positions=8, text_tokens=100)
    res.schemes.extend(schemes)
    return res


def test_parse_target() -> None:
    assert parse_target("99%") == Target("recovered", 0.99)
    assert parse_target("0.99") == Target("recovered", 0.99)
    assert parse_target("ppl:99.5%") == Target("recovered", 0.995)
    assert parse_target("top1:95%") == Target("top1", 0.95)
    assert parse_target(None) is None
    for bad in ("abc", "kl:99%", "0%", "150%", "top1:", "99%%"):
        with pytest.raises(UsageError):
            parse_target(bad)


def test_least_memory_among_those_meeting_the_floor() -> None:
    res = _result(_scheme("big", 0.999, 0.99, mem=0.60),
                  _scheme("small", 0.993, 0.90, mem=0.40),
                  _scheme("smallest-but-bad", 0.97, 0.80, mem=0.30),
                  _scheme("no-format", 0.9995, 0.95),
                  _scheme("broken", NAN, NAN, error="boom"))
    rec = recommend(res, parse_target("99%"))
    # meeting 0.99: big (0.999), small (0.993), no-format (0.9995); least memory: small (0.40)
    assert rec["scheme"] == "small"
    assert rec["meets"] == ["big", "small", "no-format"]
    assert rec["closest"] is None and rec["needs"] is None
    assert "broken" not in [c["scheme"] for c in rec["candidates"]]
    # by text top-1 >= 95%: big (0.99) and no-format (0.95); big has a memory figure
    assert recommend(res, parse_target("top1:95%"))["scheme"] == "big"
    # a floor only no-format reaches: it wins without a memory figure
    assert recommend(res, parse_target("99.92%"))["scheme"] == "no-format"


def test_equal_memory_goes_to_the_faster_then_the_better() -> None:
    res = _result(_scheme("slow", 0.995, 0.9, mem=0.5, speed=1.1),
                  _scheme("fast", 0.991, 0.9, mem=0.5, speed=1.8),
                  _scheme("unmeasured-speed", 0.999, 0.9, mem=0.5))
    assert recommend(res, parse_target("99%"))["scheme"] == "fast"
    tie = _result(_scheme("a", 0.992, 0.9, mem=0.5), _scheme("b", 0.996, 0.9, mem=0.5))
    assert recommend(tie, parse_target("99%"))["scheme"] == "b"


def test_figures_through_vllm_count_where_the_scheme_was_served() -> None:
    served = {"ppl": 10.1, "ref_ppl": 10.0, "recovered": 0.9901, "text_top1": 0.5,
              "top1": 1.0}
    res = _result(_scheme("hf-says-no", 0.95, 0.9, mem=0.4, vllm=served),
                  _scheme("hf-says-yes", 0.995, 0.9, mem=0.7,
                          vllm={"error": "vLLM could not serve it"}))
    rec = recommend(res, parse_target("99%"))
    assert rec["scheme"] == "hf-says-no"
    got = {c["scheme"]: (c["value"], c["from"]) for c in rec["candidates"]}
    assert got == {"hf-says-no": (0.9901, "vLLM"), "hf-says-yes": (0.995, "HF")}


def test_none_meets_names_the_closest_and_the_layers_to_keep() -> None:
    res = _result(_scheme("w4", 0.90, 0.7, mem=0.3), _scheme("w8", 0.965, 0.9, mem=0.55))
    calm = np.ones(16, dtype=np.float32)
    spiky = np.ones(16, dtype=np.float32)
    spiky[[5, 11]] = [40.0, 25.0]  # median 1: 40x
    mild = np.ones(16, dtype=np.float32)
    mild[2] = 4.0
    absmax = {"layers.0.mlp.down_proj": spiky, "layers.0.q_proj": calm, "layers.1.o": mild}
    calls = []

    def evidence():
        calls.append(1)
        return absmax, "recorded activation ranges of 3 Linears"

    rec = recommend(res, parse_target("99%"), evidence)
    assert rec["scheme"] is None and rec["meets"] == []
    assert rec["closest"]["scheme"] == "w8"
    assert rec["closest"]["short_by"] == pytest.approx(0.99 - 0.965)
    keep = rec["needs"]["keep_bf16"]
    assert [k["module"] for k in keep] == ["layers.0.mlp.down_proj", "layers.1.o",
                                           "layers.0.q_proj"]
    assert keep[0]["channels"][:2] == [5, 11] and keep[0]["times_median"] == pytest.approx(40)
    assert keep[1]["times_median"] == pytest.approx(4)
    assert rec["needs"]["evidence"] == "recorded activation ranges of 3 Linears"
    res.recommendation = rec
    text = res.format_table()
    assert "no scheme meets it; closest: w8 at 96.5% (HF), 2.5 points short" in text
    assert "would need: layers.0.mlp.down_proj in bf16" in text and "channels 5, 11" in text
    # the evidence is read only when it is needed
    calls.clear()
    recommend(res, parse_target("90%"), evidence)
    assert calls == []
    assert rec["needs"]["try"] is None  # w8 is no compressed-tensors scheme: no recipe


def test_a_ct_closest_gets_the_recipe_that_keeps_the_salient_linears() -> None:
    spiky = np.ones(16, dtype=np.float32)
    spiky[3] = 50.0
    mild = np.ones(16, dtype=np.float32)
    mild[1] = 5.0
    absmax = {"model.layers.0.mlp.down_proj": spiky, "model.layers.1.mlp.down_proj": mild}

    def evidence():
        return absmax, "ranges"

    # a single preset: the same preset on every decoder Linear, plus the keeps
    one = recommend(_result(_scheme("ct:W8A8", 0.9, 0.9, mem=0.6)), parse_target("99%"),
                    evidence)
    assert one["needs"]["try"] == ("ct:layers=W8A8,keep=model.layers.0.mlp.down_proj,"
                                   "keep=model.layers.1.mlp.down_proj")
    # a recipe that keeps the spikiest already: only the other is named, and added
    label = "ct:mlp=W4A16-g64,attn=W8A8,keep=model.layers.0.mlp.down_proj"
    mixed = recommend(_result(_scheme(label, 0.8, 0.9, mem=0.47)), parse_target("99%"),
                      evidence)
    assert [k["module"] for k in mixed["needs"]["keep_bf16"]] == ["model.layers.1.mlp.down_proj"]
    assert mixed["needs"]["try"] == label + ",keep=model.layers.1.mlp.down_proj"
    assert f"to measure it: --scheme {label},keep=model.layers.1.mlp.down_proj" in \
        mixed["text"][-1]


def test_json_carries_memory_and_the_recommendation() -> None:
    res = _result(_scheme("w8", 0.995, 0.95, mem=0.55), _scheme("fake", 0.9, 0.8))
    res.recommendation = recommend(res, parse_target("top1:90%"))
    doc = json.loads(json.dumps(res.to_json(), allow_nan=False))
    assert [s["memory_vs_bf16"] for s in doc["schemes"]] == [0.55, None]
    assert all("decode_speed_vs_bf16" in s for s in doc["schemes"])
    assert doc["recommendation"]["scheme"] == "w8"
    assert doc["recommendation"]["target"] == {
        "metric": "top1", "floor": 0.9, "words": "text top-1 agreement with the reference "
                                                 ">= 90%"}
    text = res.format_table()
    assert "recommendation (target text top-1 agreement with the reference >= 90%): w8: " \
           "95.0% (HF), weights 55.0% of bf16" in text
    assert "claim" not in text


def test_cli_bad_target_exits_2_before_loading(tmp_path) -> None:
    r = CliRunner().invoke(main, ["whatif", str(tmp_path / "nope.h5"), "--scheme", "int4-g128",
                                  "--target", "kl:3"])
    assert r.exit_code == 2 and "--target 'kl:3'" in r.output and "Traceback" not in r.output
    h = CliRunner().invoke(main, ["whatif", "--help"])
    assert "--target" in h.output and "top1:95%" in h.output
