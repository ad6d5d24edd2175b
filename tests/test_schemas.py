"""qforensics/schemas.py: every document the commands write, on the committed real traces,
validates against its JSON Schema with the jsonschema library, and so does every module info
row of those traces; a document broken in the ways a reader would trip on does not."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from qforensics.cli import main
from qforensics.schemas import validate, validate_module_info

REPO = Path(__file__).resolve().parent.parent
SAMPLES = sorted((REPO / "sample_traces").glob("*.h5"))


def _json(*args: str) -> dict:
    res = CliRunner().invoke(main, [*args, "--json"])
    assert res.exit_code in (0, 1), res.output[-2000:]
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def analyzed() -> dict[str, dict]:
    assert len(SAMPLES) >= 10  # the committed real traces (sample_traces/README.md)
    return {p.stem: _json("analyze", str(p)) for p in SAMPLES}


def test_analyze_documents_validate(analyzed):
    for name, doc in analyzed.items():
        assert validate(doc) == [], name
    # the corrupt checkpoint fails, the reference passes: both shapes of first_nonfinite met
    assert analyzed["corrupt-weight-nan-row"]["first_nonfinite"] is not None
    assert analyzed["fp16-reference"]["first_nonfinite"] is None


def test_several_ranks_validate(tmp_path):
    for i, name in enumerate(("fp16-reference", "corrupt-weight-nan-row")):
        (tmp_path / f"t-{i}.h5").symlink_to(REPO / "sample_traces" / f"{name}.h5")
    doc = _json("analyze", str(tmp_path / "t-0.h5"), str(tmp_path / "t-1.h5"))
    assert doc["multi_rank"] is True and validate(doc) == []


def test_diff_scan_triage_and_replay_documents_validate(tmp_path):
    from safetensors.numpy import save_file

    ref, bad = (str(REPO / "sample_traces" / f"{n}.h5")
                for n in ("fp16-reference", "int4-g128-weights"))
    assert validate(_json("diff", ref, bad)) == []
    scale = np.ones(4, np.float32)
    scale[2] = np.nan
    save_file({"model.layers.0.mlp.down_proj.weight": np.ones((4, 8), np.float32),
               "model.layers.0.mlp.down_proj.weight_scale": scale}, str(tmp_path / "m.safetensors"))
    scan = _json("scan", str(tmp_path / "m.safetensors"))
    assert scan["findings"] and validate(scan) == []
    triage = _json("triage", ref, str(REPO / "sample_traces" / "corrupt-weight-nan-row.h5"),
                   "--workers", "1", "--quiet")
    assert triage["groups"] and validate(triage) == []
    res = CliRunner().invoke(main, ["replay", str(REPO / "sample_traces" / "fp8-e4m3-nosat-act.h5"),
                                    "--json", str(tmp_path / "r.json")])
    assert res.exit_code == 1, res.output[-2000:]
    assert validate(json.loads((tmp_path / "r.json").read_text())) == []


def test_every_module_info_row_validates():
    for p in SAMPLES:
        with h5py.File(p, "r") as f:
            rows = [json.loads(x) for x in f["modules/info"][:]]
        assert rows
        for i, row in enumerate(rows):
            assert validate_module_info(row) == [], (p.name, i)


def test_broken_documents_do_not(analyzed):
    good = analyzed["corrupt-weight-nan-row"]
    breaks = {
        "version": lambda d: d.update(version="2.0"),  # a major version a reader must refuse
        "verdict/status": lambda d: d["verdict"].update(status="OK"),
        "n_steps": lambda d: d.update(n_steps="24"),
        "first_nonfinite/step": lambda d: d["first_nonfinite"].pop("step"),
        "damage/0/scale": lambda d: d["damage"][0].update(scale="NaN"),  # not the one policy
        "thresholds/ratio": lambda d: d["thresholds"].update(ratio=None),
    }
    for where, brk in breaks.items():
        doc = copy.deepcopy(good)
        brk(doc)
        problems = validate(doc)
        assert problems, where
    assert validate({"schema": "qforensics.nope", "version": "1.0"})
    assert validate_module_info({"params": {"weight": {"shape": "576x576", "dtype": "f4"}}})
    assert validate_module_info({"health": {"weight": {"nan": 1.5}}})


def test_whatif_documents_validate_and_broken_ones_do_not():
    from qforensics.jsondoc import document
    from qforensics.whatif.recommend import parse_target, recommend
    from qforensics.whatif.results import SchemeResult, WhatIfResult

    res = WhatIfResult(trace="t.h5", prompt_source="p", salient_source="s", ref_text="t",
                       ref_ppl=10.0, positions=8, text_tokens=100)
    for label, rec in (("ct:W8A8", 0.99), ("ct:W4A16-g64", float("nan"))):  # NaN: "nan"
        s = SchemeResult(label, None, None, 1.0, 0.01, 10.0 / 0.99, 0.9, rec, False, "", 1.0)
        s.memory = {"vs_bf16": 0.56}
        s.risk = {"level": "low", "line": "salient input channels"}
        res.schemes.append(s)
    res.recommendation = recommend(res, parse_target("95%"))
    good = json.loads(json.dumps(document("qforensics.whatif", res.to_json())))
    assert good["schemes"][1]["recovered"] == "nan" and validate(good) == []
    breaks = {
        "schemes/0/ppl": lambda d: d["schemes"][0].update(ppl="NaN"),
        "schemes/0/recovered": lambda d: d["schemes"][0].pop("recovered"),
        "schemes/0/risk/level": lambda d: d["schemes"][0]["risk"].update(level="bad"),
        "recommendation/target/metric": lambda d: d["recommendation"]["target"].update(
            metric="ppl"),
        "reference": lambda d: d.pop("reference"),
    }
    for where, brk in breaks.items():
        doc = copy.deepcopy(good)
        brk(doc)
        assert validate(doc), where
