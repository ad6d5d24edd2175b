"""A capture whose file stops growing mid-run (the kernel's file size limit fails the writes with
EFBIG, as a full disk fails them with ENOSPC): the host goes on and exits normally, every
step's summary and the last K steps still reach the file (as raw bytes into the regions
allocated for them), and the status and the verdict say from which step writing failed.

Each case runs disk_full_child.py in a process of its own (the limit is per process), on the
real writer and the real HDF5 library; the NaN's step and module are the ones it injects."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import qforensics
from qforensics.analyze import analyze_trace

HERE = Path(__file__).parent
STEPS, RING = 300, 16  # capture's default ring_steps


def _run(tmp_path: Path, bad: int, child: str = "disk_full_child.py", grow: int = 20000,
         steps: int = STEPS, *extra: str) -> tuple[Path, dict, str]:
    path = tmp_path / "t.h5"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(HERE.parent / "hooks"), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, str(HERE / child), str(grow), str(steps), str(bad),
                        str(path), *extra], capture_output=True, text=True, env=env,
                       timeout=600)
    # the host is never stopped: not by the failed writes, not at exit (HDF5 used to crash
    # there, SIGSEGV, on a file it could not close)
    assert p.returncode == 0, p.stderr[-3000:]
    return path, json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def _status(path: Path) -> dict:
    with qforensics.open_trace(path) as t:
        return t.meta["status"]


def test_healthy_run_keeps_every_summary_and_the_ring_and_says_writing_failed(tmp_path):
    path, out, err = _run(tmp_path, -1)
    assert "File too large" in out["degraded"]
    assert err.count("trace writing failed at step") == 1  # said once on stderr
    st = _status(path)
    assert st["state"] == "complete" and st["steps"] == STEPS
    failed_at = st["writer_failed_at_step"]
    assert 50 <= failed_at < STEPS - RING  # the limit was set at step 50
    assert "File too large" in st["writer_error"]
    mem = st["memory_ring"]
    assert mem["summaries"] and mem["ring"] == RING and mem["steps"] == [STEPS - RING, STEPS - 1]
    with qforensics.open_trace(path) as t:
        assert int(t.summary_table["count"].sum()) == STEPS  # every step, none twice
        assert t.ring_detail_steps() == list(range(STEPS - RING, STEPS))
    f = analyze_trace(path)
    # what the full detail lost is not called clean: the verdict is no PASSED
    assert f.verdict.status == "SUSPECT", f.verdict.line
    assert f.verdict.line.startswith(f"SUSPECT | no non-finite values in {STEPS} steps, but "
                                     f"trace writing failed at step {failed_at} (")
    assert f"covers steps 0-{STEPS - 1} ({STEPS} steps)" in f.verdict.line
    assert f"stopped at step {failed_at} (trace writing failed" in f.verdict.line


@pytest.mark.parametrize("bad", [STEPS - 5, 120])
def test_a_nan_after_writing_failed_is_found(tmp_path, bad):
    """Late, inside the ring: its producer from the ring's records. Earlier: its step and
    call from the summaries."""
    path, _, _ = _run(tmp_path, bad)
    assert _status(path)["writer_failed_at_step"] < bad
    f = analyze_trace(path)
    assert f.verdict.status == "FAILED", f.verdict.line
    if bad >= STEPS - RING:
        assert f.first_nonfinite is not None and f.first_nonfinite.step == bad
        assert f.first_nonfinite.producer_module == "layers.1.down"
    else:
        assert f"NaN/Inf at step {bad}" in f.verdict.line


def test_compiled_ring_steps_kept_in_memory_keep_their_channels(tmp_path):
    """Compiled mode leaves a ring step's channel ranges in the stats op's ring until the
    writer needs them (hooks/ringranges.py); once writing failed, the writer keeps the last
    ring_steps steps in memory and writes them at close, when the op's ring (ring_steps + 5
    slots) still holds them: the NaN planted late is found with its producer, and the memory
    ring's steps hold their channels, none lost."""
    steps = 120
    bad = steps - 5
    path, out, _ = _run(tmp_path, bad, "disk_full_child.py", 20000, steps, "compiled")
    assert "File too large" in out["degraded"]
    st = _status(path)
    assert st["capture_mode"] == "compiled" and st["graph_ranges"]["lazy"]
    assert st["graph_ranges"]["lost"] == 0
    assert st["memory_ring"]["ring"] == RING, st["memory_ring"]
    f = analyze_trace(path)
    assert f.verdict.status == "FAILED", f.verdict.line
    assert f.first_nonfinite is not None and f.first_nonfinite.step == bad
    assert f.first_nonfinite.producer_module == "layers.1.down"
    with qforensics.open_trace(path) as t:
        assert t.ring_detail_steps() == list(range(steps - RING, steps))
        # a healthy ring step before the NaN: its down projection's input ranges are there
        _, recs, _ = t.ring_step(bad - 1)
        [i] = np.nonzero((recs["module"] == "layers.1.down") & (recs["io"] == 0))[0][:1]
        row = {k: recs[k][i] for k in ("row", "chan_offset", "channels", "tok_offset",
                                       "tok_count")}
        lo, hi = t.channel_ranges(row)
        assert len(lo) == int(recs["channels"][i]) and (lo <= hi).all()
        assert np.isfinite(lo).all() and lo.min() < hi.max()


def test_a_flush_cut_at_close_leaves_no_torn_rows_behind(tmp_path, monkeypatch):
    """Nothing drains between step 50 and close, so the limit cuts the one flush at close,
    which had appended steps 48-119 (steps are emitted a step late): HDF5 put some of their
    columns on disk and not others (the step rows of the NaN step, its records' NaN counts
    still zero), which read as a NaN in the logits alone, or as no NaN at all. The status names
    the rows each table had at the last flush that completed; the reader leaves out the rows
    past them, and the NaN is found in the ring with its producer. A status without the counts
    (an older writer) leaves out the step rows from the failed step on."""
    steps = 120
    bad = steps - 5
    path, out, _ = _run(tmp_path, bad, "disk_full_child.py", 20000, steps, "at_close")
    assert "File too large" in out["degraded"]
    st = _status(path)
    failed_at = st["writer_failed_at_step"]
    assert 0 <= failed_at <= 50, st
    rows = st["rows_flushed"]
    with qforensics.open_trace(path) as t:
        kept = t.step_table
        assert len(kept) == rows["steps"] and int(kept["step"].max()) < failed_at
        assert t.records_end <= rows["records"]
        assert t.ring_detail_steps() == list(range(steps - RING, steps))
    f = analyze_trace(path)
    assert f.verdict.status == "FAILED", f.verdict.line
    assert f.first_nonfinite is not None and f.first_nonfinite.step == bad, f.verdict.line
    assert f.first_nonfinite.producer_module == "layers.1.down"
    assert f"full detail for steps 0-{failed_at - 1} and, in the ring," in f.verdict.line

    from qforensics.trace import reader

    raw = reader.Trace._raw_status
    monkeypatch.setattr(reader.Trace, "_raw_status", lambda self: {
        k: v for k, v in (raw(self) or {}).items() if k != "rows_flushed"})
    assert "rows_flushed" not in _status(path)
    f = analyze_trace(path)
    assert f.first_nonfinite is not None and f.first_nonfinite.step == bad, f.verdict.line
    assert f.first_nonfinite.producer_module == "layers.1.down"


def test_raw_row_writes_land_where_hdf5_reads_them(tmp_path):
    """Several chunks a row (the real model's ring rows are 1024 records of 512 a chunk): each
    raw write is read back by HDF5 at its row and columns, and nowhere else."""
    import h5py

    from qforensics.trace.rawput import RawRegion

    p = tmp_path / "r.h5"
    with h5py.File(p, "w", libver="latest") as f:  # created as the ring's are
        d = f.create_dataset("x", shape=(16, 0), maxshape=(16, None), dtype="f4", chunks=(1, 512))
        d.resize((16, 1300))
        d[:, :] = 0
        c = f.create_dataset("c", data=np.zeros(16, np.int64))
    with h5py.File(p, "r+") as f:
        fd = os.open(p, os.O_RDWR)
        try:
            raw = RawRegion(fd)
            for row in (0, 5, 13, 15):
                raw.put_row(f["x"], row, np.arange(1200, dtype=np.float32) + 10000 * row)
            raw.put(f["c"], 13, np.array([7], np.int64))
            with pytest.raises(ValueError):
                raw.put_row(f["x"], 1, np.zeros(1301, np.float32))  # wider than a row
        finally:
            os.close(fd)
    with h5py.File(p, "r") as f:
        x = f["x"][:]
        for row in range(16):
            want = np.zeros(1300, np.float32)
            if row in (0, 5, 13, 15):
                want[:1200] = np.arange(1200) + 10000 * row
            np.testing.assert_array_equal(x[row], want)
        assert f["c"][:].tolist() == [0] * 13 + [7, 0, 0]


@pytest.mark.model
def test_real_model_nan_after_the_disk_filled_is_named_with_its_producer(tmp_path):
    """SmolLM2 in HF with capture's defaults: the file stops growing 256 KiB past forward 45 (a
    few steps of full detail), and the NaN planted in layer 17's v_proj before forward 85
    (step 84) lies in the ring: found with its producer, the host unharmed."""
    tokens = 90
    path, out, err = _run(tmp_path, 85, "disk_full_real_child.py", 256 << 10, tokens)
    assert "File too large" in out["degraded"] and out["forwards"] == tokens
    st = _status(path)
    # the writer drains within its flush interval (1 s): it fails on steps before forward 45
    assert RING <= st["writer_failed_at_step"] < tokens - RING
    assert st["memory_ring"]["summaries"] and st["memory_ring"]["ring"] == RING
    f = analyze_trace(path)
    assert f.verdict.status == "FAILED", f.verdict.line
    assert f.first_nonfinite is not None and f.first_nonfinite.step == 84
    assert f.first_nonfinite.producer_module == "model.layers.17.self_attn.v_proj"
