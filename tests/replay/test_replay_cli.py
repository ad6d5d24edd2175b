"""`qforensics replay` end to end on this CPU-only machine (GPU path stubbed or absent)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from replay_helpers import FakeTrace, fake_opener, make_awq

from qforensics.cli import main
from qforensics.replay import run as run_mod
from qforensics.replay.bundle import build_bundle


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    monkeypatch.setattr(run_mod, "detect_gpu", lambda: (False, "test: no GPU"))
    import inspect
    sig = inspect.signature(run_mod.replay)
    assert "gpu_probe" in sig.parameters
    orig = run_mod.replay

    def patched(*a, **k):
        k.setdefault("gpu_probe", lambda: (False, "test: no GPU"))
        return orig(*a, **k)

    monkeypatch.setattr("qforensics.cli.replay.replay", patched)


def _bundle(tmp_path, m):
    return build_bundle(make_awq(m, 64, 64, 32), {"group_size": 32, "call_index": 3}, tmp_path / f"b{m}.h5").path


def test_help_ends_with_example():
    r = CliRunner().invoke(main, ["replay", "--help"])
    assert r.exit_code == 0
    tail = r.output.rstrip().splitlines()
    idx = max(i for i, line in enumerate(tail) if line.strip() == "Example:")
    assert idx > 0 and all(line.strip().startswith("qforensics replay") for line in tail[idx + 1:])


def test_oob_bundle_emulated_with_errors_exit_1(tmp_path):
    r = CliRunner().invoke(main, ["replay", str(_bundle(tmp_path, 3)), "--json", str(tmp_path / "r.json")])
    lines = r.output.splitlines()
    assert r.exit_code == 1, r.output
    assert lines[0] == "INCONCLUSIVE | GPU replay not run: no GPU (test: no GPU)"
    assert lines[1].startswith("EMULATED | tile rows [0, 3) (M=3 N=64 K=64 group_size=32): 40 invalid accesses over all 1 blocks (x: 40); "
                               "first: kernel qf_awq_gemm_unchecked, block (0,0,0), thread (12,0,0), reads 16 bytes at 1 bytes past the end of `x`")
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["schema"] == "qforensics-replay-result" and doc["schema_version"] == "1.0"
    assert [x["verdict"] for x in doc["results"]] == ["INCONCLUSIVE", "EMULATED"]
    assert doc["results"][0]["reason"] == "no GPU"
    assert doc["results"][1]["first"]["buffer"] == "x" and doc["results"][1]["errors"] == 40
    assert doc["call_index"] == 3 and doc["shapes"]["M"] == 3


def test_in_bounds_bundle_emulated_clean_exit_0(tmp_path):
    r = CliRunner().invoke(main, ["replay", str(_bundle(tmp_path, 8)), "--emulate"])
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[0] == ("EMULATED | tile rows [0, 8) (M=8 N=64 K=64 group_size=32): 0 invalid accesses "
                                        "over all 1 blocks; output equals the float64 reference on 512 in-bounds outputs")


def test_gpu_only_without_gpu_exit_3(tmp_path):
    r = CliRunner().invoke(main, ["replay", str(_bundle(tmp_path, 8)), "--gpu"])
    assert r.exit_code == 3 and r.output.startswith("INCONCLUSIVE | GPU replay not run: no GPU")


def test_unreadable_input_exit_2(tmp_path):
    bad = tmp_path / "x.h5"
    bad.write_text("nope")
    r = CliRunner().invoke(main, ["replay", str(tmp_path / "missing.h5")])
    assert r.exit_code == 2 and "no such file" in r.output
    r = CliRunner().invoke(main, ["replay", str(_bundle(tmp_path, 8)), "--call", "4"])
    assert r.exit_code == 2 and "--call applies to traces only" in r.output
    r = CliRunner().invoke(main, ["replay", str(_bundle(tmp_path, 8)), "--tool", "leakcheck"])
    assert r.exit_code == 2


def test_trace_input_builds_bundle(tmp_path, monkeypatch):
    snap = make_awq(3, 64, 64, 32)
    trace = FakeTrace({5: ("first_nonfinite_output", snap)}, {"quant": {"bits": 4, "group_size": 32, "format": "awq"}})
    (tmp_path / "trace.h5").write_bytes(b"")  # exists; the fake opener supplies the content
    orig = run_mod.build_bundle_from_trace
    monkeypatch.setattr(run_mod, "build_bundle_from_trace",
                        lambda p, o, c, open_trace=None: orig(p, o, c, open_trace=fake_opener(trace)))
    r = CliRunner().invoke(main, ["replay", str(tmp_path / "trace.h5"), "--bundle-out", str(tmp_path / "out.h5")])
    assert r.exit_code == 1, r.output
    assert (tmp_path / "out.h5").is_file() and f"bundle: {tmp_path / 'out.h5'}" in r.output


def test_full_launch_geometry_reported_for_tiles(tmp_path):
    snap = make_awq(100, 64, 64, 32)
    snap["output.0"] = np.zeros((100, 64), np.float32)
    snap["output.0"][97, 1] = np.inf
    p = build_bundle(snap, {"group_size": 32}, tmp_path / "t.h5").path
    r = CliRunner().invoke(main, ["replay", str(p), "--emulate"])
    lines = r.output.splitlines()
    assert lines[0].startswith("EMULATED | tile rows [96, 100) (M=4 ")
    assert lines[1].startswith("EMULATED | full launch M=100 (M=100 N=64 K=64 group_size=32): 32 invalid accesses")
    assert r.exit_code == 1
