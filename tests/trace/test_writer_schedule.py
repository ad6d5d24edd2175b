"""When the trace writer writes: every batch on disk within flush_interval of its submit, and
as few writes as that promise allows (each write has a fixed cost on the model's thread)."""

from __future__ import annotations

import time

import numpy as np
import pytest

import qforensics
from qforensics.trace import schema
from qforensics.trace import writer as writer_mod
from qforensics.trace.writer import StepBatch, TraceWriter


def _batch(step: int) -> StepBatch:
    st = np.zeros(1, schema.step_dtype())
    st["step"] = step
    st["first_nonfinite_call"] = st["first_nonfinite_record"] = -1
    z = np.zeros(0, np.float32)
    return StepBatch(steps=st, records=np.zeros(0, schema.record_dtype()), chan_min=z,
                     chan_max=z, tok_absmax=z, input_ids=np.zeros(0, np.int64))


def _writer(path, interval: float) -> TraceWriter:
    return TraceWriter(path, modules=[{"name": "lin"}], environment={}, capture_options={},
                       flush_interval=interval)


@pytest.mark.parametrize("step_s", [0.045, 0.19, 0.45, 0.6])
def test_every_batch_within_the_interval_and_few_writes(tmp_path, monkeypatch, step_s):
    """Steps at a steady pace (shorter than the interval: longer ones are the writer thread's,
    which the simulated clock does not drive) on a simulated clock: each write's oldest batch is younger than
    flush_interval when written, batches go out in order, and a write carries as many steps as
    fit in the interval (at least as many as one write per half interval would)."""
    now = [1000.0]
    monkeypatch.setattr(writer_mod, "_clock", lambda: now[0])
    w = _writer(tmp_path / "s.h5", 1.0)
    submitted: dict[int, float] = {}
    writes: list[tuple[float, list[int]]] = []
    real_write = w._write

    def spy(batches):
        writes.append((now[0], [int(b.steps["step"][0]) for b in batches]))
        real_write(batches)

    w._write = spy
    n = int(20.0 / step_s) + 1
    for s in range(n):
        now[0] += step_s
        submitted[s] = now[0]
        w.submit(_batch(s))
    w.close({"state": "complete"})
    in_time = [st for t, steps in writes[:-1] for st in steps]  # the last is close's
    assert in_time == list(range(len(in_time))) and len(in_time) > 0
    for t, steps in writes[:-1]:
        assert t - submitted[steps[0]] < 1.0, (t, steps)
    # one write per half interval was the earlier rule; fewer writes now
    per_half = max(1, int(np.ceil(0.5 / step_s)))
    assert len(in_time) / len(writes[:-1]) >= per_half
    assert len(writes[:-1]) <= 20.0 / 0.5 * 0.75
    with qforensics.open_trace(tmp_path / "s.h5") as t:
        assert t.n_steps == n


def test_the_writer_thread_writes_what_waits(tmp_path):
    """One batch and no step after it (an idle server): the writer thread puts it on disk
    within the interval, with no flush() asked for."""
    w = _writer(tmp_path / "idle.h5", 0.3)
    try:
        t0 = time.monotonic()
        w.submit(_batch(0))
        while w.steps_written == 0 and time.monotonic() - t0 < 5.0:
            time.sleep(0.01)
        waited = time.monotonic() - t0
        assert w.steps_written == 1
        assert 0.3 * 0.8 <= waited < 0.3 + 0.5  # not at once, and not long after its deadline
        w.submit(_batch(1))  # a second idle period works the same
        t1 = time.monotonic()
        while w.steps_written == 1 and time.monotonic() - t1 < 5.0:
            time.sleep(0.01)
        assert w.steps_written == 2
    finally:
        w.close({"state": "complete"})
    with qforensics.open_trace(tmp_path / "idle.h5") as t:
        assert t.n_steps == 2
