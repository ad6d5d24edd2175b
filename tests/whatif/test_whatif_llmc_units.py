"""``llmc:`` scheme specs, calibration windows and the CLI's refusals, without llmcompressor (the
runs that need its venv are in test_whatif_llmc.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from qforensics.cli import main
from qforensics.errors import UsageError
from qforensics.whatif.llmc import twin_ct
from qforensics.whatif.llmc_worker import calibration_windows
from qforensics.whatif.schemes import parse_whatif_scheme

SAMPLE = Path(__file__).resolve().parents[2] / "sample_traces" / "fp16-reference.h5"


def test_llmc_specs_parse_to_the_recipe_and_preset():
    g = parse_whatif_scheme("llmc:gptq-w4a16-G64")
    assert (g.label, g.library, g.algo, g.preset) == \
        ("llmc:GPTQ-W4A16-g64", "llmcompressor", "gptq", "W4A16-g64")
    assert twin_ct(g) == "ct:W4A16-g64"
    s = parse_whatif_scheme("llmcompressor:SQ-W8A8")
    assert (s.label, s.algo, s.preset, twin_ct(s)) == ("llmc:SQ-W8A8", "sq-gptq", "W8A8",
                                                        "ct:W8A8")


@pytest.mark.parametrize("bad, why", [
    ("llmc:SQ-W4A16", "quantize activations"),  # SmoothQuant without activation quantization
    ("llmc:GPTQ-FP8_DYNAMIC", "integer weights"),  # GPTQ's grid is an integer one
    ("llmc:GPTQ-W9A9", "not a compressed-tensors preset"),
    ("llmc:AWQ-W4A16", "llmc:GPTQ-PRESET"),
    ("llmc:GPTQ-W8A8-g64", "per channel"),  # -g<N> on a per-channel preset
])
def test_bad_llmc_specs_are_refused_with_the_reason(bad, why):
    with pytest.raises(UsageError, match=why):
        parse_whatif_scheme(bad)


def test_calibration_windows_are_consecutive_and_disjoint():
    ids = list(range(1000))
    wins = calibration_windows(ids, 16, 128)
    assert len(wins) == 1000 // 128  # the text runs out before 16 windows
    assert wins[0] == list(range(128)) and wins[1][0] == 128
    assert all(len(w) == 128 for w in wins)
    assert calibration_windows(ids, 3, 128) == [ids[0:128], ids[128:256], ids[256:384]]
    assert calibration_windows(ids[:100], 16, 128) == []


def test_cli_missing_llmc_python_exits_2_before_loading(tmp_path):
    r = CliRunner().invoke(main, ["whatif", str(SAMPLE), "--scheme", "llmc:GPTQ-W4A16-g64",
                                  "--llmc-python", str(tmp_path / "nope" / "python")])
    assert r.exit_code == 2, r.output
    assert "install-llmc.sh" in r.output and "Traceback" not in r.output


def test_cli_llmc_python_without_llmcompressor_exits_2(tmp_path):
    import sys

    r = CliRunner().invoke(main, ["whatif", str(SAMPLE), "--scheme", "llmc:SQ-W8A8",
                                  "--llmc-python", sys.executable])
    import importlib.util

    assert importlib.util.find_spec("llmcompressor") is None  # this test's premise
    assert r.exit_code == 2, r.output
    assert "llmcompressor does not import there" in r.output


def test_help_shows_an_llmc_example():
    r = CliRunner().invoke(main, ["whatif", "--help"])
    assert r.exit_code == 0 and "llmc:GPTQ-W4A16-g64" in r.output and "--llmc-python" in r.output


def test_a_scheme_not_measured_is_shown_with_its_reason():
    from qforensics.whatif.results import SchemeResult, WhatIfResult

    nan = float("nan")
    res = WhatIfResult(trace=None, prompt_source="p", salient_source="s", ref_text="t",
                       ref_ppl=10.0, positions=8, text_tokens=100)
    res.schemes.append(SchemeResult("ct:W8A8", "compressed-tensors W8A8", None, 1.0, 0.01, 10.5,
                                    0.9, 10.0 / 10.5, False, "t", 1.0))
    res.schemes.append(SchemeResult("llmc:SQ-W8A8", "llmcompressor W8A8", None, nan, nan, nan,
                                    nan, nan, False, "", 0.0,
                                    error="llmcompressor failed (exit 3): ValueError: boom"))
    table = res.format_table()
    row = next(ln for ln in table.splitlines() if ln.startswith("llmc:SQ-W8A8 "))
    assert row.split()[1:] == ["-"] * 7  # five figures, the memory and the risk: none
    assert "llmc:SQ-W8A8: not measured: llmcompressor failed (exit 3): ValueError: boom" in table
    assert "claim" not in table and "99.4" not in table and "claim" not in res.to_json()
    js = res.to_json()["schemes"][1]
    # not measured: NaN figures, written as jsondoc writes every non-finite float
    assert js["error"].endswith("boom") and js["ppl"] == "nan" and js["recovered"] == "nan"
