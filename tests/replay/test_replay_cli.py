"""`qforensics replay` end to end on this CPU-only machine: real kernels on recorded data, verdicts,
exit codes, --export, and no temp files left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from replay_helpers import make_awq

from qforensics.cli import main
from qforensics.replay import run as run_mod
from qforensics.replay.build import build_bundle

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "sample_traces" / "fp8-e4m3-nosat-act.h5"


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    orig = run_mod.replay

    def patched(*a, **k):
        k.setdefault("gpu_probe", lambda: (False, "test: no GPU"))
        return orig(*a, **k)

    monkeypatch.setattr("qforensics.cli.replay.replay", patched)


def _bundle(tmp_path, m, k=64, g=32, name="b"):
    return build_bundle(make_awq(m, 64, k, g, groups=-(-k // g)), {"group_size": g, "call_index": 3},
                        tmp_path / f"{name}{m}.h5").path


def test_help_ends_with_example():
    r = CliRunner().invoke(main, ["replay", "--help"])
    assert r.exit_code == 0
    tail = r.output.rstrip().splitlines()
    idx = max(i for i, line in enumerate(tail) if line.strip() == "Example:")
    assert idx > 0 and all(line.strip().startswith("qforensics replay") for line in tail[idx + 1:])


def test_sample_trace_is_data_naming_the_channels_over_range(tmp_path):
    """The fp8-e4m3-nosat NaN comes from activations beyond e4m3's range, not from a kernel."""
    from qforensics.trace.reader import open_trace

    with open_trace(SAMPLE) as t:
        snaps = t.snapshots
        call = int(snaps[snaps["reason"] == "first_nonfinite_output"]["call_index"].min())
        x = np.asarray(t.snapshot_tensors(call)["input.0"], dtype=np.float64).reshape(-1, 1536)
    # e4m3fn's largest finite value is 448; a non-saturating cast turns |x| >= 464 (the midpoint
    # to the next binade step) into NaN
    expected = sorted(int(c) for c in np.flatnonzero((np.abs(x) >= 464).any(axis=0)))
    assert expected  # the sample has such channels
    r = CliRunner().invoke(main, ["replay", str(SAMPLE), "--json", str(tmp_path / "r.json")])
    assert r.exit_code == 1, r.output
    assert "FIXTURE" in r.output.splitlines()[1]
    doc = json.loads((tmp_path / "r.json").read_text())
    assert (doc["schema"], doc["version"]) == ("qforensics.replay", "3.0") and doc["fixture"] is True and doc["layout"] == "qforensics-fakequant"
    data, san = doc["results"]
    assert data["verdict"] == "DATA" and san["verdict"] == "INCONCLUSIVE" and san["reason"] == "no GPU"
    named = sorted(c["channel"] for c in data["details"]["facts"]["overflowing_input_channels"])
    assert named == expected
    assert doc["shapes"]["N_full"] == 576 and doc["shapes"]["K"] == 1536 and doc["call_index"] == call


def test_planted_group_index_bug_diverges_only_when_k_is_not_a_multiple_of_g(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), str(REPO)]))
    ragged = _bundle(tmp_path, 8, k=160, g=64, name="ragged")  # 3 groups, the last one partial
    r = CliRunner().invoke(main, ["replay", str(ragged), "--launcher", "planted_kernels:awq_gemm_wrong_group",
                                  "--sanitize", "off", "--json", str(tmp_path / "d.json")])
    assert r.exit_code == 1, r.output
    res = json.loads((tmp_path / "d.json").read_text())["results"][0]
    assert res["verdict"] == "KERNEL DIVERGES"
    # rows whose group the bug gets wrong, computed here: k // 64 vs k * 3 // 160
    wrong_rows = np.flatnonzero(np.arange(160) // 64 != np.arange(160) * 3 // 160)
    assert wrong_rows.size and res["details"]["diverging"] > 0 and res["details"]["first"][0][0] == 0
    even = _bundle(tmp_path, 8, k=128, g=64, name="even")
    r = CliRunner().invoke(main, ["replay", str(even), "--launcher", "planted_kernels:awq_gemm_wrong_group",
                                  "--sanitize", "off"])
    assert r.exit_code == 0 and "NOT REPRODUCED | planted_kernels:awq_gemm_wrong_group agrees" in r.output


def test_torch_int4_kernel_not_reproduced_and_export_runs_standalone(tmp_path):
    b = _bundle(tmp_path, 8, k=128, g=64)
    out = tmp_path / "repro"
    r = CliRunner().invoke(main, ["replay", str(b), "--kernel", "torch-int4pack", "--export", str(out)])
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[1].startswith("NOT REPRODUCED | torch-int4pack agrees with the finite float64 reference")
    assert sorted(p.name for p in out.iterdir()) == ["geometry.json", "repro.py", "tensors.safetensors"]
    geo = json.loads((out / "geometry.json").read_text())
    assert geo["K"] == 128 and geo["kernel_under_judgement"] == "torch-int4pack" and "torch" in geo["versions"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(out / "repro.py")], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    err = float(proc.stdout.split("max |y - reference| = ")[1].split()[0])
    from safetensors.numpy import load_file

    ref = load_file(str(out / "tensors.safetensors"))["y_reference"]
    assert err < 0.05 * np.abs(ref).max()  # bf16 activations: well inside a few percent of the output range


def test_kernel_not_callable_is_inconclusive_and_says_what_would_run(tmp_path):
    r = CliRunner().invoke(main, ["replay", str(_bundle(tmp_path, 8))])
    assert r.exit_code == 1
    line = r.output.splitlines()[1]
    assert line.startswith("INCONCLUSIVE | the trace does not say which kernel the run used")
    assert "--kernel torch-int4pack" in line


def test_unreadable_or_inconsistent_input_exit_2(tmp_path):
    bad = tmp_path / "x.h5"
    bad.write_text("nope")
    r = CliRunner().invoke(main, ["replay", str(tmp_path / "missing.h5")])
    assert r.exit_code == 2 and "no such file" in r.output
    r = CliRunner().invoke(main, ["replay", str(_bundle(tmp_path, 8)), "--call", "4"])
    assert r.exit_code == 2 and "--call applies to traces only" in r.output
    r = CliRunner().invoke(main, ["replay", str(_bundle(tmp_path, 8)), "--tool", "leakcheck"])
    assert r.exit_code == 2
    import h5py

    p = _bundle(tmp_path, 8, name="contra")
    with h5py.File(p, "a") as f:
        meta = json.loads(f.attrs["meta"])
        meta["group_size"] = 16  # contradicts the 2 scale rows of K=64
        f.attrs["meta"] = json.dumps(meta)
    r = CliRunner().invoke(main, ["replay", str(p)])
    assert r.exit_code == 2 and "contradict" in r.output and len(r.output.strip().splitlines()) == 1


def test_no_temp_files_outlive_a_run(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), str(REPO)]))
    for extra in ([], ["--launcher", "planted_kernels:awq_gemm_wrong_group"], ["--kernel", "torch-int4pack"]):
        CliRunner().invoke(main, ["replay", str(SAMPLE if not extra else _bundle(tmp_path, 8, k=128, g=64)), *extra])
    assert list((tmp_path / "tmp").iterdir()) == []
