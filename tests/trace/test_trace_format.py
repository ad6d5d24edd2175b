"""The reader treats traces as untrusted input: versions, links, offsets, snapshots."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest

import qforensics
from qforensics.errors import TraceFormatError, TraceVersionError
from qforensics.trace import schema
from qforensics.trace.writer import StepBatch, TraceWriter, compact_trace


def _write(path, n_steps=3, close=True, flush_interval=0.05):
    w = TraceWriter(path, modules=[{"name": "lin", "type": "Linear", "kind": "linear",
                                    "info": "{}"}], environment={"torch": "x"},
                    capture_options={}, flush_interval=flush_interval)
    for s in range(n_steps):
        rec = np.zeros(2, schema.record_dtype())
        rec["call_index"] = [2 * s, 2 * s]
        rec["step"] = s
        rec["io"] = [0, 1]
        rec["channels"] = 4
        rec["rows"] = 1
        rec["numel"] = 4
        rec["absmax"] = [1.0, 2.0 + s]
        rec["chan_offset"] = [0, 4]
        rec["tok_offset"] = [0, 1]
        rec["tok_count"] = 1
        st = np.zeros(1, schema.step_dtype())
        st["step"] = s
        st["record_count"] = 2
        st["first_nonfinite_call"] = -1
        st["first_nonfinite_record"] = -1
        st["token_count"] = 1
        w.submit(StepBatch(steps=st, records=rec, chan_min=np.arange(8.0) - 10,
                           chan_max=np.arange(8.0), tok_absmax=np.array([1.0, 2.0 + s]),
                           input_ids=np.array([s])))
    if close:
        w.close({"state": "complete"})
    return w


def test_round_trip(tmp_path):
    _write(tmp_path / "t.h5")
    with qforensics.open_trace(tmp_path / "t.h5") as t:
        assert t.format_version == schema.FORMAT_VERSION
        assert t.n_steps == 3
        assert t.steps.record_offset.tolist() == [0, 2, 4]
        r = t.records(2)
        assert r.row.tolist() == [4, 5] and r.absmax.tolist() == [1.0, 4.0]
        cmin, cmax = t.channel_ranges(5)
        assert cmax.tolist() == [4, 5, 6, 7] and cmin.tolist() == [-6, -5, -4, -3]
        assert t.input_ids(1).tolist() == [1]
        assert t.meta["environment"] == {"torch": "x"}
        assert t.end.complete and t.end.reason == "complete: 3 steps"


def test_refuses_newer_major_and_reads_newer_minor(tmp_path, caplog):
    p = tmp_path / "t.h5"
    _write(p)
    with h5py.File(p, "a") as f:
        f.attrs["format_version"] = "2.0"
    with pytest.raises(TraceVersionError, match="newer than this qforensics reads.*upgrade"):
        qforensics.open_trace(p)
    with h5py.File(p, "a") as f:
        f.attrs["format_version"] = "1.7"
    with qforensics.open_trace(p) as t:
        assert t.n_steps == 3
    assert "newer" in caplog.text


def test_refuses_links_and_non_traces(tmp_path):
    p = tmp_path / "t.h5"
    _write(p)
    with h5py.File(p, "a") as f:
        f["meta/evil"] = h5py.ExternalLink("/etc/passwd", "/")
    with pytest.raises(TraceFormatError, match="refusing links"):
        qforensics.open_trace(p)
    q = tmp_path / "other.h5"
    with h5py.File(q, "w") as f:
        f["x"] = 1
    with pytest.raises(TraceFormatError, match="not a qforensics trace"):
        qforensics.open_trace(q)
    r = tmp_path / "text.h5"
    r.write_text("hello")
    with pytest.raises(TraceFormatError, match="not an HDF5 file"):
        qforensics.open_trace(r)
    with pytest.raises(TraceFormatError, match="no such file"):
        qforensics.open_trace(tmp_path / "missing.h5")


def test_bad_offsets_and_types_are_errors_not_crashes(tmp_path):
    p = tmp_path / "t.h5"
    _write(p)
    with h5py.File(p, "a") as f:
        f["records/chan_offset"][5] = 10**9
        f["records/module_id"][0] = 7
    with qforensics.open_trace(p) as t:
        with pytest.raises(TraceFormatError, match="out of bounds"):
            t.channel_ranges(5)
        with pytest.raises(TraceFormatError, match="module_id out of range"):
            t.records(0)
    q = tmp_path / "u.h5"
    _write(q)
    with h5py.File(q, "a") as f:
        del f["records/absmax"]
        f["records/absmax"] = np.array(["a"] * 6, dtype="S1")
    with pytest.raises(TraceFormatError, match="absmax"):
        qforensics.open_trace(q)


def test_snapshot_validation(tmp_path):
    p = tmp_path / "t.h5"
    w = _write(p, close=False)
    row = np.zeros(1, schema.snapshot_dtype())
    row["call_index"] = 1
    row["reason"] = b"first_nonfinite_output"
    row["name"] = b"input.0"
    row["dtype"] = b"float32"
    row["shape"] = b"[2, 2]"
    row["nbytes"] = 16
    st = np.zeros(0, schema.step_dtype())
    w.submit(StepBatch(steps=st, records=np.zeros(0, schema.record_dtype()),
                       chan_min=np.zeros(0), chan_max=np.zeros(0), tok_absmax=np.zeros(0),
                       input_ids=np.zeros(0, np.int64), snapshots=row,
                       snapshot_bytes=np.frombuffer(np.arange(4, dtype="<f4").tobytes(),
                                                    np.uint8)))
    w.close()
    with qforensics.open_trace(p) as t:
        got = t.snapshot_tensors(1)
        np.testing.assert_array_equal(got["input.0"], [[0, 1], [2, 3]])
    with h5py.File(p, "a") as f:
        f["snapshots/index/dtype"][0] = b"object"
    with qforensics.open_trace(p) as t:
        with pytest.raises(TraceFormatError, match="not allowed"):
            t.snapshot_tensors(1)
    with h5py.File(p, "a") as f:
        f["snapshots/index/dtype"][0] = b"float32"
        f["snapshots/index/shape"][0] = b"[3, 3]"
    with qforensics.open_trace(p) as t:
        with pytest.raises(TraceFormatError, match="do not hold"):
            t.snapshot_tensors(1)


def test_killed_writer_leaves_a_readable_truncated_trace(tmp_path):
    """A real SIGKILL of a process in the middle of writing."""
    p = tmp_path / "k.h5"
    code = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(tmp_path)!r})
        import numpy as np
        from test_helpers_kill import _write
        w = _write({str(p)!r}, n_steps=5, close=False)
        assert w.flush()  # barrier: the 5 steps are on disk
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    src = open(__file__).read()
    (tmp_path / "test_helpers_kill.py").write_text(src)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    with qforensics.open_trace(p) as t:
        assert t.n_steps == 5
        assert not t.end.complete
        assert "never closed" in t.end.reason and "after step 4" in t.end.reason
        assert len(t.records(4)) == 2


def test_flush_is_a_barrier(tmp_path):
    """With a periodic flush far away, `flush()` alone puts every submitted step on disk, where
    a second reader (SWMR) sees them while the writer is still open."""
    p = tmp_path / "b.h5"
    w = _write(p, n_steps=4, close=False, flush_interval=3600.0)
    try:
        assert w.flush(timeout=60)
        with h5py.File(p, "r", swmr=True) as f:
            assert f["steps/step"][:].tolist() == [0, 1, 2, 3]
            assert f["records/step"].shape[0] == 2 * 4
    finally:
        w.close({"state": "complete"})
    assert w.flush()  # after close: nothing left to wait for


def test_compact_copy_reads_the_same(tmp_path):
    _write(tmp_path / "t.h5")
    compact_trace(tmp_path / "t.h5", tmp_path / "c.h5")
    with qforensics.open_trace(tmp_path / "c.h5") as t:
        assert t.n_steps == 3 and t.end.complete
