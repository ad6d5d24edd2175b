"""The trace's one byte budget for any duration (format 1.2): summaries of every step, the
ring's full detail, pinned failure windows; real HDF5 files written through the real writer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest

import qforensics
from qforensics.analyze import analyze_trace
from qforensics.errors import CaptureError
from qforensics.trace.budgetopts import max_bytes_from_env, parse_max_bytes

sys.path.insert(0, os.path.dirname(__file__))
from budget_batches import batch, engine_batch, write_run, writer  # noqa: E402

MIB = 1 << 20


def test_budget_never_exceeded_and_every_step_summarized(tmp_path):
    p = tmp_path / "t.h5"
    budget = 16 * MIB
    w = writer(p, budget)
    n = 6000
    sizes = []
    for s in range(n):
        w.submit(batch(s))
        if s % 500 == 0:
            w.flush()
            sizes.append(os.path.getsize(p))
    w.close()
    sizes.append(os.path.getsize(p))
    assert max(sizes) <= budget
    assert w.capped_at is not None and w.capped_at < n - 500  # the run outgrew full detail
    with qforensics.open_trace(p) as t:
        summ = t.summary_table
        assert int(summ["count"].sum()) == n  # every step, none dropped
        assert int(summ["step_lo"][0]) == 0 and int(summ["step_hi"][-1]) == n - 1
        assert t.summary_state["steps_seen"] == n
        # the logits range each row keeps is that of the steps fed (-10, 10)
        assert float(summ["logits_min"].min()) == -10.0 and float(summ["logits_max"].max()) == 10
        assert int(summ["nonfinite_steps"].sum()) == 0
        # the last K steps in full detail, in the ring
        assert t.ring_detail_steps() == list(range(n - 8, n))
        srow, recs, tok = t.ring_step(n - 1)
        assert int(srow["step"][0]) == n - 1 and len(recs) == 80 and len(tok) == 80
        cmin, cmax = t.channel_ranges(recs.row(3))
        assert np.allclose(cmin, np.linspace(-1, 1, 64) - 1)
        assert t.n_steps < n  # full detail was thinned: the verdict says so
    f = analyze_trace(p)
    assert f.verdict.status == "PASSED" and f"{n} steps" in f.verdict.line
    assert f"covers steps 0-{n - 1}" in f.verdict.line and "stopped at step" in f.verdict.line


def test_the_cap_counts_rows_appended_since_the_last_flush(tmp_path):
    """HDF5 gives appended rows their chunks only when it flushes them: until then the file's
    size on disk leaves them out. A budget check made after an append in the same write (a
    pinned window after the regular detail) must count them, or the file passes max_bytes
    (seen on the real model: 43.1 MB under a 40 MiB budget, one run in three)."""
    p = tmp_path / "t.h5"
    budget = 16 * MIB
    w = writer(p, budget)
    w.submit(batch(0))
    w.flush()
    with w._lock:
        on_disk = os.path.getsize(p)
        w._append("channels/min", np.zeros(MIB, w.channel_dtype))  # 4 MiB, not yet flushed
        assert os.path.getsize(p) < on_disk + MIB  # not on disk yet
        room = budget - on_disk - (64 << 10) - MIB  # what the stale size would leave
        assert not w._within_cap(room)  # the 4 MiB appended are counted
        assert os.path.getsize(p) >= on_disk + 4 * MIB
        assert w._within_cap(budget - os.path.getsize(p) - (64 << 10))
    w.close()


def test_summaries_consolidate_to_coarser_rows(tmp_path):
    p = tmp_path / "t.h5"
    w = writer(p, 16 * MIB)
    w._summaries.__init__(256)  # a small table: several consolidations in 3,000 steps
    write_run(w, 3000, nan_at={1234, 2000})
    with qforensics.open_trace(p) as t:
        state, summ = t.summary_state, t.summary_table
        assert state["resolution"] == 16  # 3000 / 256 rows -> 11.7 -> the next power of two
        assert int(summ["count"].sum()) == 3000
        assert set((summ["step_hi"] - summ["step_lo"] + 1).tolist()) <= {16, 3000 % 16}
        assert int(summ["nonfinite_steps"].sum()) == 2
        first = summ["first_nonfinite_step"][summ["first_nonfinite_step"] >= 0]
        assert first.tolist() == [1234, 2000]


def test_pinned_failure_at_step_1_survives_hours(tmp_path):
    p = tmp_path / "t.h5"
    budget = 16 * MIB
    w = writer(p, budget)
    n = 30_000  # at 0.5 s a step: over 4 hours
    write_run(w, n, nan_at={1}, dt=0.5)
    assert os.path.getsize(p) <= budget
    with qforensics.open_trace(p) as t:
        summ = t.summary_table
        assert float(summ["t_last"].max() - summ["t_first"].min()) > 4 * 3600
        assert int(summ["count"].sum()) == n
        assert 1 in t.steps.step.tolist()
        pins = t.pinned_table
        assert pins["step"].tolist()[:1] == [1] and bool(pins["kept"][0])
    f = analyze_trace(p)
    assert f.status == "FAILED" and f.exit_code == 1
    assert f.first_nonfinite.step == 1 and f.first_nonfinite.module == "layers.7.proj"
    assert f.first_nonfinite.producer_module == "layers.7.proj"
    assert f"covers steps 0-{n - 1} ({n} steps)" in f.verdict.line


def test_later_failure_found_in_the_ring_when_no_window_fits(tmp_path, monkeypatch):
    p = tmp_path / "t.h5"
    w = writer(p, 13 * MIB)  # full detail stops after about 1,000 steps
    monkeypatch.setattr(type(w), "_append_pinned", lambda self, window, new: False)
    n = 3000
    write_run(w, n, nan_at={n - 3}, nan_module=11)
    with qforensics.open_trace(p) as t:
        assert (n - 3) not in t.steps.step.tolist()  # neither appended nor pinned
        assert (n - 3) in t.ring_detail_steps()
        assert not bool(t.pinned_table["kept"][0])
    f = analyze_trace(p)
    assert f.status == "FAILED" and f.first_nonfinite.step == n - 3
    assert f.first_nonfinite.producer_module == "layers.11.proj"
    assert "not (no room left)" in f.verdict.line


def test_failure_only_in_the_summaries_is_still_failed(tmp_path, monkeypatch):
    p = tmp_path / "t.h5"
    w = writer(p, 13 * MIB)
    monkeypatch.setattr(type(w), "_append_pinned", lambda self, window, new: False)
    write_run(w, 3000, nan_at={2000})  # 1,000 steps later the ring has moved on
    f = analyze_trace(p)
    assert f.status == "FAILED" and f.first_nonfinite is None
    assert "NaN/Inf at step 2000" in f.verdict.line and "covers steps 0-2999" in f.verdict.line


def test_old_capped_trace_without_summaries_never_passes(tmp_path):
    p, old = tmp_path / "t.h5", tmp_path / "old.h5"
    write_run(writer(p, 13 * MIB), 3000)
    qforensics.trace.writer.compact_trace(p, old)
    with h5py.File(old, "a") as f:  # what a 1.1 writer left: no summaries, no ring detail
        for name in ("summary", "pinned", "ring/steps", "ring/records", "ring/tokens",
                     "ring/detail"):
            del f[name]
        f.attrs["format_version"] = "1.1"
    f = analyze_trace(old)
    assert f.status == "SUSPECT" and "were not seen" in f.verdict.line


_KILLED = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {here!r})
    from budget_batches import batch, writer
    w = writer({path!r}, 13 << 20, flush_interval=0.2)
    told = False
    for s in range(100000):
        w.submit(batch(s))
        if not told and w.steps_written > 2500:  # on disk past step 2500, by the schedule alone
            print("written", flush=True)
            told = True
        time.sleep(0.0005)  # the point: a run's steps take time; the writer writes on its clock
""")


def test_kill_9_mid_run_keeps_the_ring_and_the_summaries(tmp_path):
    p = tmp_path / "k.h5"
    code = _KILLED.format(here=os.path.dirname(__file__), path=str(p))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "written"  # then kill it mid-run
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    with qforensics.open_trace(p) as t:
        assert not t.end.complete  # the writer never sealed it
        seen = t.summary_state["steps_seen"]
        assert seen > 2500
        ring = t.ring_detail_steps()
        assert len(ring) >= 6 and max(ring) >= seen - 8  # the last steps, in full detail
        assert all(len(t.ring_step(s)[1]) == 80 for s in ring)
        assert t.limits["reached_at_step"] >= 0
    f = analyze_trace(p)
    assert f.status == "SUSPECT" and "never closed" in f.verdict.line


def test_budget_that_cannot_hold_the_ring_is_a_capture_error(tmp_path):
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    with pytest.raises(CaptureError, match=r"max_bytes=.*cannot hold .*ring of the last 16"):
        qforensics.capture(model, tmp_path / "t.h5", max_bytes=2 * MIB).attach()
    assert not (tmp_path / "t.h5").exists()
    with pytest.raises(CaptureError, match="byte count"):
        qforensics.capture(model, tmp_path / "t.h5", max_bytes="1G")  # type: ignore[arg-type]
    with qforensics.capture(model, tmp_path / "ok.h5") as cap:  # the 1 GiB default holds
        model(torch.zeros(1, 64))
    assert cap.options["max_bytes"] == 1 << 30


def test_max_bytes_forms_and_the_environment_variable():
    assert parse_max_bytes("1073741824") == 1 << 30
    assert parse_max_bytes("1G") == parse_max_bytes("1GiB") == 1 << 30
    assert parse_max_bytes("512MiB") == 512 << 20 and parse_max_bytes("0") == 0
    for bad in ("", "1 XB", "-5", "ten"):
        with pytest.raises(ValueError, match="not a byte count"):
            parse_max_bytes(bad)
    assert max_bytes_from_env({}) is None
    assert max_bytes_from_env({"QFORENSICS_MAX_BYTES": "2g"}) == 2 << 30
    with pytest.raises(ValueError, match="QFORENSICS_MAX_BYTES"):
        max_bytes_from_env({"QFORENSICS_MAX_BYTES": "lots"})


def test_record_options_read_the_environment_variable(monkeypatch):
    import click

    from qforensics.hooks.recordenv import options_from_env
    from qforensics.cli.options import capture_kwargs

    base = dict(flush_interval=1.0, channel_dtype="float32", channel_steps="auto",
                modules_spec="default", snapshot_budget_mib=64.0, outlier_threshold=448.0)
    monkeypatch.delenv("QFORENSICS_MAX_BYTES", raising=False)
    assert capture_kwargs(**base)["max_bytes"] == 1 << 30
    monkeypatch.setenv("QFORENSICS_MAX_BYTES", "256M")
    assert capture_kwargs(**base)["max_bytes"] == 256 << 20
    assert capture_kwargs(**base, max_bytes_mib=64)["max_bytes"] == 64 << 20  # option wins
    monkeypatch.setenv("QFORENSICS_OPTIONS", "{}")
    assert options_from_env()["max_bytes"] == 256 << 20
    monkeypatch.setenv("QFORENSICS_OPTIONS", '{"max_bytes": 1234}')
    assert options_from_env()["max_bytes"] == 1234
    monkeypatch.setenv("QFORENSICS_MAX_BYTES", "lots")
    with pytest.raises(click.BadParameter, match="not a byte count"):
        capture_kwargs(**base)


def test_summaries_count_bad_requests_and_leave_warmups_out(tmp_path):
    from qforensics.trace import schema

    p = tmp_path / "t.h5"
    w = writer(p, 16 * MIB)
    for s in range(6):
        b = batch(s, nan_module=30 if s in (0, 4) else None)
        es = np.zeros(1, schema.engine_dtype("steps"))
        es["step"], es["warmup"] = s, int(s == 0)  # step 0: a warm-up forward
        b.engine = {"steps": es}
        if s == 4:  # the root's per-request flag record: requests 1 and 2 of 3 went bad
            flag = np.zeros(1, schema.record_dtype())
            flag["step"], flag["module_id"], flag["io"], flag["slot"] = 4, 39, 1, 1
            flag["tok_offset"], flag["tok_count"], flag["chan_offset"] = len(b.tok_absmax), 3, -1
            b.records = np.concatenate([b.records, flag])
            b.tok_absmax = np.concatenate([b.tok_absmax, np.array([0, 1, 1], np.float32)])
        w.submit(b)
    w.close()
    with qforensics.open_trace(p) as t:
        summ = t.summary_table
        assert int(summ["warmup"].sum()) == 1
        assert int(summ["nonfinite_steps"].sum()) == 1  # the warm-up's NaN drives nothing
        bad = summ["first_nonfinite_step"][summ["first_nonfinite_step"] >= 0]
        assert bad.tolist() == [4] and int(summ["bad_requests"].sum()) == 2


def test_failure_without_a_trigger_is_pinned_from_its_summary(tmp_path):
    p = tmp_path / "t.h5"
    write_run(writer(p, 13 * MIB), 3000, nan_at={2500}, triggers=False)
    with qforensics.open_trace(p) as t:
        assert t.limits["reached_at_step"] < 2500 and 2500 in t.steps.step.tolist()
        assert t.pinned_table["kind"].tolist() == ["nonfinite"]
    f = analyze_trace(p)
    assert f.status == "FAILED" and f.first_nonfinite.step == 2500


def test_a_warmup_whose_engine_tables_came_first_is_never_the_pinned_failure(tmp_path):
    """vLLM's order: a step's engine tables are submitted on their own before its records.
    Its compiled warm-up runs a dummy batch that makes NaN; the budget then has room for one
    first-failure window, and the real failure (step 2500) must be the one that gets it."""
    from qforensics.trace import schema

    def engine_only(step: int, warm: bool):
        es = np.zeros(1, schema.engine_dtype("steps"))
        es["step"], es["warmup"] = step, int(warm)
        return engine_batch(steps=es)

    p = tmp_path / "t.h5"
    w = writer(p, 13 * MIB)
    for s in range(3000):
        w.submit(engine_only(s, warm=s == 0))
        # the warm-up's NaN carries no trigger (the flight recorder leaves warm-ups out)
        w.submit(batch(s, nan_module=7 if s in (0, 2500) else None, triggers=s != 0))
        if s % 64 == 63:
            w.flush()
    w.close()
    with qforensics.open_trace(p) as t:
        assert t.limits["reached_at_step"] < 2500
        pins = t.pinned_table
        assert pins["step"].tolist() == [2500] and pins["kind"].tolist() == ["nonfinite"]
        assert 2500 in t.steps.step.tolist()
        summ = t.summary_table
        bad = summ["first_nonfinite_step"][summ["first_nonfinite_step"] >= 0]
        assert bad.tolist() == [2500]
    f = analyze_trace(p)
    assert f.status == "FAILED" and f.first_nonfinite.step == 2500


def test_every_request_keeps_its_id_long_after_full_detail_stopped(tmp_path):
    """A server takes new requests for days after the budget stopped appending full detail:
    the requests table has room of its own, so each request's id is still there to name."""
    from qforensics.trace import schema

    def new_request(step: int):
        rq = np.zeros(1, schema.engine_dtype("requests"))
        rq["request"], rq["first_step"], rq["prompt_tokens"] = step, step, 10 + step % 7
        rq["request_id"] = f"cmpl-{step:06d}".encode()
        return engine_batch(requests=rq)

    p = tmp_path / "t.h5"
    w = writer(p, 13 * MIB)
    for s in range(3000):
        w.submit(new_request(s))
        w.submit(batch(s))
        if s % 64 == 63:
            w.flush()
    w.close()
    assert p.stat().st_size <= 13 * MIB
    with qforensics.open_trace(p) as t:
        assert 0 <= t.limits["reached_at_step"] < 2000  # a thousand requests came after
        reqs = t.engine_table("requests")
    assert len(reqs) == 3000
    assert reqs["request_id"].tolist()[-1] == "cmpl-002999"
