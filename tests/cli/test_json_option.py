"""`--json [PATH]` is one option across the commands: alone (or `-`) it puts the JSON alone on
stdout, with a name ending in .json or with `=` it writes that file and keeps the text report
on stdout, and it never takes a trace for its PATH. Expectations are read from the traces with
h5py, or planted in the inputs, never copied from the tool's output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from qforensics.cli import COMMANDS, main
from qforensics.cli.jsonout import JsonCommand, split_json_args
from qforensics.errors import EXIT_FINDING, EXIT_OK, EXIT_USAGE

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "sample_traces"
HEALTHY = SAMPLES / "fp16-reference.h5"
CORRUPT = SAMPLES / "corrupt-weight-nan-row.h5"
NOSAT = SAMPLES / "fp8-e4m3-nosat-act.h5"
JSON_COMMANDS = {"analyze", "diff", "scan", "triage", "replay", "whatif"}


def _strict(text: str) -> dict:
    """JSON with no bare NaN / Infinity (the one non-finite policy writes strings)."""
    def refuse(name: str) -> None:
        raise AssertionError(f"bare {name} in the JSON")
    return json.loads(text, parse_constant=refuse)


def _first_nonfinite(path: Path) -> tuple[int, int, str]:
    """(step, call, module) of the first output holding NaN/Inf, straight from the file."""
    with h5py.File(path, "r") as f:
        calls = f["steps/first_nonfinite_call"][:]
        steps = f["steps/step"][:]
        i = int(np.flatnonzero(calls >= 0)[0])
        call = int(calls[i])
        rec = np.flatnonzero((f["records/call_index"][:] == call) & (f["records/io"][:] == 1))
        module = f["modules/name"][int(f["records/module_id"][rec[0]])]
        return int(steps[i]), call, module.decode() if isinstance(module, bytes) else str(module)


def _n_steps(path: Path) -> int:
    with h5py.File(path, "r") as f:
        return len(f["steps/step"])


def _invoke(*args: str):
    res = CliRunner().invoke(main, list(args))
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return res


@pytest.mark.parametrize("given, seen", [
    (["t.h5", "--json"], ["t.h5", "--json=-"]),
    (["--json", "t.h5"], ["--json=-", "t.h5"]),
    (["t.h5", "--json", "out.json"], ["t.h5", "--json=out.json"]),
    (["t.h5", "--json", "OUT.JSON", "--top", "2"], ["t.h5", "--json=OUT.JSON", "--top", "2"]),
    (["t.h5", "--json", "-"], ["t.h5", "--json=-"]),
    (["t.h5", "--json=notes.txt"], ["t.h5", "--json=notes.txt"]),
    (["--json", "--top", "2", "t.h5"], ["--json=-", "--top", "2", "t.h5"]),
    (["t.h5", "--", "--json", "x.json"], ["t.h5", "--", "--json", "x.json"]),
])
def test_a_word_after_json_is_its_path_only_when_it_names_json(given, seen):
    assert split_json_args(given) == seen


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_json_command_shares_the_option_and_shows_it(name):
    import click

    cmd = main.get_command(click.Context(main), name)
    has_json = any("--json" in p.opts for p in cmd.params)
    assert has_json == (name in JSON_COMMANDS), name
    if not has_json:
        return
    assert isinstance(cmd, JsonCommand)  # so `--json` takes an optional PATH
    res = _invoke(name, "--help")
    assert res.exit_code == 0
    assert "--json [PATH]" in res.output and "--json=PATH" in res.output, res.output
    example = res.output[res.output.rfind("Example"):]
    assert f"qforensics {name}" in example and "--json" in example, example


def test_readme_line_writes_the_file_and_keeps_the_text(tmp_path):
    # README: qforensics analyze trace-*.h5 --json out.json, with the shell expanding the glob
    os.symlink(HEALTHY, tmp_path / "trace-0.h5")
    os.symlink(CORRUPT, tmp_path / "trace-1.h5")
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run(f"{sys.executable} -m qforensics.cli analyze trace-*.h5 --json out.json",
                         shell=True, cwd=tmp_path, env=env, text=True, capture_output=True,
                         timeout=300)
    assert res.returncode == EXIT_FINDING, res.stderr[-2000:]
    doc = _strict((tmp_path / "out.json").read_text())
    assert (doc["schema"], doc["multi_rank"]) == ("qforensics.analyze", True)
    assert [r["trace"] for r in doc["ranks"]] == ["trace-0.h5", "trace-1.h5"]
    assert [r["n_steps"] for r in doc["ranks"]] == [_n_steps(HEALTHY), _n_steps(CORRUPT)]
    step, call, module = _first_nonfinite(CORRUPT)
    fn = doc["ranks"][1]["first_nonfinite"]
    assert (fn["step"], fn["call_index"], fn["module"]) == (step, call, module)
    assert doc["ranks"][0]["first_nonfinite"] is None
    # the text report stays on stdout; the file is named on stderr
    assert res.stdout.startswith(doc["verdict"]["line"]) and "wrote out.json" in res.stderr


def test_bare_json_before_the_trace_reads_the_trace(tmp_path):
    before = CORRUPT.read_bytes()
    res = _invoke("analyze", "--json", str(CORRUPT))
    assert res.exit_code == EXIT_FINDING
    doc = _strict(res.stdout)  # stdout is the JSON alone
    step, call, module = _first_nonfinite(CORRUPT)
    fn = doc["first_nonfinite"]
    assert (fn["step"], fn["call_index"], fn["module"]) == (step, call, module)
    assert doc["trace"] == str(CORRUPT) and doc["n_steps"] == _n_steps(CORRUPT)
    assert CORRUPT.read_bytes() == before


@pytest.mark.parametrize("form", [["--json", "-"], ["--json=-"]])
def test_dash_is_stdout(form):
    res = _invoke("analyze", str(HEALTHY), *form)
    assert res.exit_code == EXIT_OK
    assert _strict(res.stdout)["n_steps"] == _n_steps(HEALTHY)


def test_equals_form_takes_any_name(tmp_path):
    out = tmp_path / "findings.txt"
    res = _invoke("analyze", str(HEALTHY), f"--json={out}")
    assert res.exit_code == EXIT_OK
    doc = _strict(out.read_text())
    assert doc["verdict"]["status"] == "PASSED" and res.stdout.startswith("PASSED |")


def test_a_json_path_that_is_an_input_or_a_directory_is_refused(tmp_path):
    copy = tmp_path / "t.h5"
    copy.write_bytes(HEALTHY.read_bytes())
    for args in (["analyze", str(copy), f"--json={copy}"],
                 ["diff", str(HEALTHY), str(copy), f"--json={copy}"],
                 ["replay", str(copy), f"--json={copy}"],
                 ["whatif", str(copy), "--table", f"--json={copy}"],
                 ["analyze", str(copy), f"--json={tmp_path}"],
                 ["analyze", str(copy), "--json="]):
        res = _invoke(*args)
        assert res.exit_code == EXIT_USAGE, (args, res.output)
        assert "--json" in res.stderr, (args, res.stderr)
    assert copy.read_bytes() == HEALTHY.read_bytes()


def test_diff_json_on_stdout_writes_non_finite_scores_as_strings():
    res = _invoke("diff", str(HEALTHY), str(NOSAT), "--json")
    assert res.exit_code == EXIT_FINDING
    doc = _strict(res.stdout)
    assert doc["schema"] == "qforensics.diff" and doc["version"].split(".")[0] == "1"
    bad = [r for r in doc["ranked"] if r["nonfinite"]]
    assert bad
    with h5py.File(NOSAT, "r") as f:
        rec = f["records"]
        for r in bad:
            hit = ((rec["call_index"][:] == r["suspect_call_index"]) & (rec["io"][:] == r["io"])
                   & (rec["slot"][:] == r["slot"]))
            assert (rec["nan_count"][hit] + rec["inf_count"][hit]).sum() > 0
            assert r["score"] in ("nan", "inf", "-inf") or isinstance(r["score"], float)
    assert any(r["score"] in ("nan", "inf", "-inf") for r in bad)


def test_scan_json_file_and_stdout(tmp_path):
    from safetensors.numpy import save_file

    w = np.ones((4, 8), dtype=np.float32)
    w.flat[13] = np.nan
    save_file({"w": w}, str(tmp_path / "model.safetensors"))
    res = _invoke("scan", str(tmp_path / "model.safetensors"), "--json", str(tmp_path / "s.json"))
    assert res.exit_code == EXIT_FINDING
    doc = _strict((tmp_path / "s.json").read_text())
    [nan] = [f for f in doc["findings"] if f["check"] == "nan"]
    assert (nan["tensor"], nan["first_index"], nan["count"]) == ("w", 13, 1)
    assert "FAILED" in res.stdout  # the text report beside the file
    res = _invoke("scan", "--json", str(tmp_path / "model.safetensors"))
    assert _strict(res.stdout)["findings"] == doc["findings"]


def test_replay_json_on_stdout_is_what_report_reads(tmp_path):
    res = _invoke("replay", str(NOSAT), "--json")
    assert res.exit_code == EXIT_FINDING
    doc = _strict(res.stdout)  # the verdict lines are not on stdout
    assert doc["schema"] == "qforensics.replay" and "version" in doc
    _, call, module = _first_nonfinite(NOSAT)
    assert (doc["call_index"], doc["module"]) == (call, module)
    p = tmp_path / "replay.json"
    p.write_text(res.stdout)
    rep = _invoke("report", str(NOSAT), "-o", str(tmp_path / "r.html"), "--replay", str(p))
    assert rep.exit_code == EXIT_OK, rep.output
    html = (tmp_path / "r.html").read_text()
    assert 'id="replay"' in html and doc["results"][0]["verdict"] in html


def test_triage_json_file_keeps_the_text(tmp_path):
    fleet = tmp_path / "fleet"
    fleet.mkdir()
    os.symlink(HEALTHY, fleet / "a.h5")
    os.symlink(CORRUPT, fleet / "b.h5")
    res = _invoke("triage", str(fleet), "--json", str(tmp_path / "t.json"), "--workers", "1",
                  "--quiet")
    assert res.exit_code == EXIT_FINDING, res.output
    doc = _strict((tmp_path / "t.json").read_text())
    assert (doc["schema"], doc["traces"], doc["healthy"]) == ("qforensics.triage", 2, 1)
    [g] = doc["groups"]
    assert g["verdict"] == "FAILED" and g["traces"] == [str(fleet / "b.h5")]
    assert g["producer"] == _first_nonfinite(CORRUPT)[2]
    assert res.stdout.startswith("FAILED | 2 traces")
