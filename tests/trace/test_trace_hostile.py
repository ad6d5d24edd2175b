"""Hostile traces through the CLI: links and virtual datasets refused, offsets that would wrap in
int64 refused, negative counts, deep JSON, non-finite integers, damaged chunks, a deleted /meta,
summaries that lie, and files cut short. Never a traceback, never a false PASSED."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from qforensics.errors import EXIT_FINDING, EXIT_OK, EXIT_USAGE
from qforensics.trace.reader import open_trace
from qforensics.trace.validate import (
    checked_span,
    parse_json,
    read_prefix,
    recorded_size,
    valid_spans,
)
from qforensics.errors import TraceFormatError

from hostile import FAILING, PASSING, chunk_span, copy, flip_byte, plain_column, run, sample


def test_the_unmutated_samples_give_the_expected_verdicts():
    assert run("analyze", sample(PASSING)).code == EXIT_OK
    assert run("analyze", sample(FAILING)).code == EXIT_FINDING


@pytest.mark.parametrize("command", ["analyze", "report", "diff"])
def test_virtual_dataset_is_refused(tmp_path, command):
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["x"] = np.full(3864, 7, dtype=np.int64)
    t = copy(PASSING, tmp_path)
    with h5py.File(t, "r+") as f:
        n = f["records/nan_count"].shape[0]
        del f["records/nan_count"]
        layout = h5py.VirtualLayout(shape=(n,), dtype=np.int64)
        layout[:] = h5py.VirtualSource(str(other), "x", shape=(n,))
        f["records"].create_virtual_dataset("nan_count", layout)
    args = {"analyze": [t], "report": [t, "-o", tmp_path / "r.html"],
            "diff": [sample(PASSING), t]}[command]
    r = run(command, *args)
    assert r.code == EXIT_USAGE, r
    assert "virtual dataset" in r.err and "/records/nan_count" in r.err


@pytest.mark.parametrize("kind", ["external link", "soft link", "external storage"])
def test_links_and_external_storage_are_refused(tmp_path, kind):
    t = copy(PASSING, tmp_path)
    raw = tmp_path / "raw.bin"
    raw.write_bytes(np.zeros(8, np.int64).tobytes())
    with h5py.File(t, "r+") as f:
        if kind == "external link":
            f["steps/extra"] = h5py.ExternalLink(str(sample(FAILING)), "/steps/step")
        elif kind == "soft link":
            f["meta/alias"] = h5py.SoftLink("/steps")
        else:
            f.create_dataset("tokens/ext", shape=(8,), dtype=np.int64,
                             external=[(str(raw), 0, 64)])
    r = run("analyze", t)
    assert r.code == EXIT_USAGE and "refusing" in r.err, r
    assert {"external link": "ExternalLink", "soft link": "SoftLink",
            "external storage": "external storage"}[kind] in r.err


def test_offsets_that_wrap_int64_are_never_passed(tmp_path):
    t = copy(PASSING, tmp_path)
    with h5py.File(t, "r+") as f:
        f["steps/record_offset"][0] = 2**62
        f["steps/record_count"][0] = 2**62  # offset + count = 2**63 wraps in int64
    r = run("analyze", t)
    assert r.code == EXIT_FINDING and r.first.startswith("SUSPECT | "), r
    assert "point past the data" in r.out
    assert "PASSED" not in r.first


def test_span_checks_use_python_ints():
    with pytest.raises(TraceFormatError):
        checked_span(2**62, 2**62, 10**6, "x")
    with pytest.raises(TraceFormatError):
        checked_span(5, -1, 10, "x")
    with pytest.raises(TraceFormatError):
        checked_span(float("inf"), 1, 10, "x")
    assert checked_span(np.int64(3), np.int32(4), 7, "x") == (3, 7)
    off = np.array([2**62, 0, 5, -1, 3], np.int64)
    cnt = np.array([2**62, 7, -2, 1, 4], np.int64)
    assert valid_spans(off, cnt, 7).tolist() == [False, True, False, False, True]


def test_negative_channel_count_is_refused(tmp_path):
    t = copy(FAILING, tmp_path)
    with h5py.File(t, "r+") as f:
        chans = f["records/channels"]
        offs = f["records/chan_offset"][:]
        rows = np.nonzero(offs >= 0)[0]
        chans[int(rows[0])] = -5
    with open_trace(t) as tr:
        with pytest.raises(TraceFormatError, match="out of bounds"):
            tr.channel_ranges(int(rows[0]))
    r = run("analyze", t)
    assert r.code in (EXIT_USAGE, EXIT_FINDING), r
    assert "PASSED" not in r.first


def test_deep_json_is_refused_without_recursion_error(tmp_path):
    t = copy(PASSING, tmp_path)
    with h5py.File(t, "r+") as f:
        f["meta"].attrs["environment"] = "[" * 100_000 + "]" * 100_000
    r = run("analyze", t)
    assert r.code == EXIT_USAGE and "nested deeper" in r.err, r
    with pytest.raises(TraceFormatError, match="nested deeper"):
        parse_json('{"a": ' * 65 + "1" + "}" * 65, "x")
    assert parse_json('{"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}',
                      "x")  # brackets inside strings do not count


def test_non_finite_integer_fields_do_not_crash(tmp_path):
    t = copy(PASSING, tmp_path)
    with h5py.File(t, "r+") as f:
        env = json.loads(f["meta"].attrs["environment"])
        env["world_size"] = float("inf")
        env["rank"] = float("nan")
        f["meta"].attrs["environment"] = json.dumps(env)  # writes Infinity / NaN literals
    r = run("analyze", t, "--json")
    assert r.code == EXIT_OK, r
    doc = json.loads(r.out)
    assert doc["world_size"] == 1 and doc["rank"] == 0


def test_deleted_meta_is_refused(tmp_path):
    t = copy(PASSING, tmp_path)
    with h5py.File(t, "r+") as f:
        del f["meta"]
    r = run("analyze", t)
    assert r.code == EXIT_USAGE and "no /meta group" in r.err, r


def test_damaged_record_chunk_is_named_and_never_passed(tmp_path):
    t = copy(PASSING, tmp_path)
    off, size = chunk_span(t, "records/nan_count")
    flip_byte(t, off + size // 2)
    with pytest.raises(OSError):  # the damage is real: plain h5py cannot read the column
        plain_column(t, "records/nan_count")
    r = run("analyze", t)
    assert r.code == EXIT_FINDING and r.first.startswith("SUSPECT | "), r
    assert "/records rows from 0 on" in r.out


def test_summaries_that_hide_a_nan_are_overruled_by_the_records(tmp_path):
    t = copy(FAILING, tmp_path)
    nan = plain_column(t, "records/nan_count") + plain_column(t, "records/inf_count")
    rec_steps = plain_column(t, "records/step")
    first_bad_step = int(rec_steps[np.nonzero(nan > 0)[0][0]])
    with h5py.File(t, "r+") as f:
        n = f["steps/step"].shape[0]
        f["steps/n_nonfinite_records"][:] = np.zeros(n, np.int64)
        f["steps/first_nonfinite_record"][:] = np.full(n, -1, np.int64)
        f["steps/first_nonfinite_call"][:] = np.full(n, -1, np.int64)
        # the logits counts too: a step bad in its logits alone is a bad step (trace.badstep)
        f["steps/logits_nan"][:] = np.zeros(n, np.int64)
        f["steps/logits_inf"][:] = np.zeros(n, np.int64)
    r = run("analyze", t)
    assert r.code == EXIT_FINDING and r.first.startswith(f"FAILED | first non-finite at step "
                                                         f"{first_bad_step}, call "), r
    assert "the records are trusted" in " ".join(r.out.split())


def _cut(src, dst, n_missing: int):
    data = src.read_bytes()
    dst.write_bytes(data[:len(data) - n_missing])
    return dst


def test_one_byte_short_passing_trace_is_read_and_not_passed(tmp_path):
    t = _cut(sample(PASSING), tmp_path / "cut.h5", 1)
    assert recorded_size(str(t)) == sample(PASSING).stat().st_size
    r = run("analyze", t)
    assert r.code == EXIT_FINDING and r.first.startswith("SUSPECT | "), r
    n_steps = plain_column(sample(PASSING), "steps/step").shape[0]
    assert f"the readable part ends after step {n_steps - 1} ({n_steps} steps)" in " ".join(
        r.out.split())
    assert "1 missing at the end" in r.out


def test_one_byte_short_failing_trace_still_names_the_failing_step(tmp_path):
    t = _cut(sample(FAILING), tmp_path / "cut.h5", 1)
    call = plain_column(sample(FAILING), "steps/first_nonfinite_call")
    step = plain_column(sample(FAILING), "steps/step")
    i = int(np.nonzero(call >= 0)[0][0])
    r = run("analyze", t)
    assert r.code == EXIT_FINDING, r
    assert r.first.startswith(f"FAILED | the step summaries record NaN/Inf at step {step[i]} "
                              f"(first at call {call[i]})"), r.first


def test_a_trace_cut_in_half_is_unreadable_input(tmp_path):
    src = sample(PASSING)
    t = _cut(src, tmp_path / "half.h5", src.stat().st_size // 2)
    r = run("analyze", t)
    assert r.code == EXIT_USAGE and "cut short" in r.err, r


def test_read_prefix_stops_at_the_damaged_chunk(tmp_path):
    p = tmp_path / "chunks.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("x", data=np.arange(40, dtype=np.int64), chunks=(10,), compression="gzip")
    off, size = chunk_span(p, "x", 2)
    flip_byte(p, off + size // 2)
    with h5py.File(p, "r") as f:
        rows, bad = read_prefix(f["x"], 0, 40)
    assert bad == 20 and rows.tolist() == list(range(20))


def test_an_unknown_module_kind_is_never_passed(tmp_path):
    t = copy(PASSING, tmp_path)
    with h5py.File(t, "r+") as f:
        f["modules/kind"][0] = "lXnear"  # what a flipped byte in the string heap looks like
    r = run("analyze", t)
    assert r.code == EXIT_FINDING and r.first.startswith("SUSPECT | "), r
    assert "/modules/kind[0] is 'lXnear', not a module kind" in " ".join(r.out.split())


def test_diff_against_a_damaged_trace_is_never_passed(tmp_path):
    clean = run("diff", sample(PASSING), sample("int4-g128-salient1pct"))
    assert clean.code == EXIT_OK, clean  # the documented good fix: no divergence jump
    t = copy("int4-g128-salient1pct", tmp_path)
    off, size = chunk_span(t, "records/nan_count")
    flip_byte(t, off + size // 2)
    r = run("diff", sample(PASSING), t)
    assert r.code in (EXIT_FINDING, EXIT_USAGE) and not r.first.startswith("PASSED"), r


def test_any_damaged_record_column_is_never_passed(tmp_path):
    """The verdict does not read /records/mean, but a trace whose records cannot all be read is
    still never PASSED."""
    t = copy(PASSING, tmp_path)
    off, size = chunk_span(t, "records/mean")
    flip_byte(t, off + size // 2)
    with pytest.raises(OSError):
        plain_column(t, "records/mean")
    r = run("analyze", t)
    assert r.code == EXIT_FINDING and r.first.startswith("SUSPECT | "), r


def test_step_block_matches_plain_h5py_and_refuses_spans_past_the_end(tmp_path):
    path = sample(FAILING)
    with h5py.File(path, "r") as f:
        step = int(f["steps/step"][0])
        off, n = int(f["steps/record_offset"][0]), int(f["steps/record_count"][0])
        c_off = f["records/chan_offset"][off:off + n]
        c_n = f["records/channels"][off:off + n]
        stored = np.nonzero(c_off >= 0)[0]
        i = int(stored[len(stored) // 2])
        want_min = f["channels/min"][c_off[i]:c_off[i] + c_n[i]].astype(np.float32)
        n_chan = f["channels/min"].shape[0]
    with open_trace(path) as tr:
        block = tr.step_block(step)
        got = block.channels(off + i)
        assert got is not None and np.array_equal(got[0], want_min, equal_nan=True)
        assert sorted(block.rows) == sorted(int(off + k) for k in stored)
    t = copy(FAILING, tmp_path)
    with h5py.File(t, "r+") as f:
        f["records/channels"][off + i] = n_chan  # offset + count now past /channels
    with open_trace(t) as tr:
        with pytest.raises(TraceFormatError, match="points past the data"):
            tr.step_block(step)
