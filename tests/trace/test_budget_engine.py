"""A serving engine's tables under the byte budget: vLLM's adapter submits a step's /engine
rows in batches of their own (before the step's records, its sampled tokens after). Once full
detail stops, a pinned window keeps its steps' engine rows, and every request keeps its id."""

from __future__ import annotations

import os
import sys

import numpy as np

import qforensics
from qforensics.trace import schema
from qforensics.trace.writer import StepBatch

sys.path.insert(0, os.path.dirname(__file__))
from budget_batches import batch, writer  # noqa: E402

MIB = 1 << 20


def _engine(step: int, request: int, new: bool) -> StepBatch:
    """The engine batch vLLM's adapter submits as a step starts: its step row, one decode
    token row of `request` at position `step`, and the request's row when it is new."""
    st = np.zeros(1, schema.engine_dtype("steps"))
    st["step"], st["n_rows"], st["n_requests"] = step, 1, 1
    rows = np.zeros(1, schema.engine_dtype("rows"))
    rows["step"], rows["request"], rows["position"], rows["phase"] = step, request, step, 1
    tables = {"steps": st, "rows": rows}
    if new:
        req = np.zeros(1, schema.engine_dtype("requests"))
        req["request"], req["first_step"], req["prompt_tokens"] = request, step, 4
        req["request_id"] = f"req-{request}".encode()
        tables["requests"] = req
    e = np.zeros(0, np.float32)
    return StepBatch(steps=np.zeros(0, schema.step_dtype()),
                     records=np.zeros(0, schema.record_dtype()), chan_min=e, chan_max=e,
                     tok_absmax=e, input_ids=np.zeros(0, np.int64), engine=tables)


def test_pinned_windows_keep_their_engine_rows_after_the_budget(tmp_path):
    p = tmp_path / "t.h5"
    w = writer(p, 13 * MIB, window=4)
    bad = {2500, 2700}
    for s in range(3000):
        request = s // 500  # a new request every 500 steps: 2000, 2500 come after the cap
        w.submit(_engine(s, request, new=s % 500 == 0))
        w.submit(batch(s, nan_module=7 if s in bad else None))
        if s % 64 == 63:
            w.flush()
    w.close()
    with qforensics.open_trace(p) as t:
        status = t.meta["status"]
        assert "writer_error" not in status  # the failure after the cap is written
        stopped = t.limits["reached_at_step"]
        assert 0 < stopped < 2000  # the first step left out, even when its engine rows led
        assert [s for s in t.steps.step.tolist() if s < 2496] == list(range(stopped))
        assert t.pinned_table["step"].tolist() == [2500, 2700]
        assert t.pinned_table["kept"].tolist() == [1, 1]
        rows = t.engine_columns("rows")
        late = sorted(int(s) for s in rows["step"] if s > t.limits["reached_at_step"])
        # each pinned step with the 4 steps before it, as in /steps
        want = [s for b in sorted(bad) for s in range(b - 4, b + 1)]
        assert late == want
        assert want == [s for s in t.steps.step.tolist() if s > t.limits["reached_at_step"]]
        at = rows["step"] == 2700
        assert rows["request"][at].tolist() == [5] and rows["position"][at].tolist() == [2700]
        reqs = t.engine_columns("requests")
        assert reqs["request_id"].tolist() == [f"req-{i}" for i in range(6)]
        assert reqs["first_step"].tolist() == [0, 500, 1000, 1500, 2000, 2500]


def _big_step_run(p, warmup: bool) -> None:
    """Step 1 is a forward 600 times wider than a decode (vLLM's warm-up on its dummy batch,
    or a long prefill): the per-step estimate the pinned windows are reserved by grows with it.
    A new request every 100 steps; a NaN at step 900."""
    w = writer(p, 13 * MIB, window=4)
    for s in range(1000):
        eng = _engine(s, s // 100, new=s % 100 == 0)
        if s == 1 and warmup:
            eng.engine["steps"]["warmup"] = 1
        w.submit(eng)
        w.submit(batch(s, width=64 * 600 if s == 1 else 64,
                       nan_module=7 if s == 900 else None))
        if s % 64 == 63:
            w.flush()
    w.close()


def test_every_request_keeps_its_id_when_the_windows_reserve_fills_the_budget(tmp_path):
    """After a forward so wide that the windows' reserve takes all the room left, requests
    still draw on the room kept for them: none is lost with the held engine rows."""
    p = tmp_path / "t.h5"
    _big_step_run(p, warmup=False)
    with qforensics.open_trace(p) as t:
        reqs = t.engine_columns("requests")
        assert reqs["request_id"].tolist() == [f"req-{i}" for i in range(10)]
        assert reqs["first_step"].tolist() == list(range(0, 1000, 100))
        assert t.pinned_table["step"].tolist() == [900]


def test_a_warmup_forward_never_sizes_the_reserved_windows(tmp_path):
    """The same wide forward flagged warm-up (never pinned): the windows are reserved by the
    served steps' size, so full detail goes on well past it (a 4-step window of decodes is
    ~0.2 MiB of this 13 MiB budget)."""
    wide, warm = tmp_path / "wide.h5", tmp_path / "warm.h5"
    _big_step_run(wide, warmup=False)
    _big_step_run(warm, warmup=True)
    with qforensics.open_trace(wide) as a, qforensics.open_trace(warm) as b:
        assert 0 <= a.limits["reached_at_step"] < 100  # reserved by the wide step's size
        assert b.limits["reached_at_step"] == -1 or b.limits["reached_at_step"] > 500
        assert b.engine_columns("requests")["request_id"].tolist() == [
            f"req-{i}" for i in range(10)]
