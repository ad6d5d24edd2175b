"""The compiled step's end (hooks/graphlate.py) on the GPU's path, run on the CPU: what the
model's thread dispatches there. A GPU step takes ~2 ms; each op the host launches at its end
costs it a launch and an allocation, and reading anything back a sync."""

from __future__ import annotations

import collections
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import qforensics
from qforensics.hooks import graphlate, graphmode, graphstats

from capture_models import Tiny

# ops that compute nothing: views, and the copies that move a step's slot to the host
_MOVES = {"view", "_unsafe_view", "reshape", "select", "slice", "detach", "alias", "as_strided",
          "unsqueeze", "squeeze", "expand", "t", "transpose", "copy_", "empty", "lift_fresh"}


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.seen[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_a_gpu_like_step_end_dispatches_only_the_stats_op(tmp_path, monkeypatch):
    """The ring read through host copies by the drainer (as on a GPU): once every host slot's
    buffers exist, the model's thread at a step's end runs the stats op on the logits and
    moves bytes (the slot, the last logits row, the ids), nothing else: no allocation, and the
    logits' figures computed on the host when the step is emitted, not by ~30 small ops on the
    device every step. (It reads one int from host memory, through numpy: the previous
    step's copy of the first-failure word, graphread.copied_first.)"""
    monkeypatch.setattr(graphlate, "LATE_ON_CPU", True)
    monkeypatch.setattr(graphstats, "HOST_COPIES_ON_CPU", True)
    monkeypatch.setattr(graphmode, "DRAIN", "thread")  # emission off the model's thread
    # every step whole (its logits figures checked below): on a loaded machine the drainer can
    # fall 8 steps behind, and a spilled step keeps no logits figures on the GPU's path
    monkeypatch.setattr(graphlate.GraphLate, "_spill", lambda self, item: None)
    per_step: list[collections.Counter] = []
    orig = graphlate.GraphLate._graph_end

    def counted(self, complete):  # noqa: ANN001, ANN202
        with _Ops() as ops:  # this thread's dispatches only
            orig(self, complete)
        per_step.append(ops.seen)

    monkeypatch.setattr(graphlate.GraphLate, "_graph_end", counted)
    comp = torch.compile(Tiny(), dynamic=True)
    seq = torch.tensor([[1, 2, 3, 4]])
    with qforensics.capture(comp, tmp_path / "t.h5") as cap, torch.no_grad():
        for _ in range(40):
            comp(seq)
        slots = cap._gs.host_slots
    assert len(per_step) == 40 and slots < 36
    for seen in per_step[slots + 1:]:  # every host slot allocated by then
        compute = {k: v for k, v in seen.items() if k not in _MOVES}
        assert compute == {"stats": 1}, seen
        assert "empty" not in seen, seen
        # the slot's segment, its token rows, the first-failure word, the logits row and the
        # ids: each copied once, straight to the host slot
        assert seen["copy_"] == 5, seen
    t = qforensics.open_trace(tmp_path / "t.h5")
    assert t.steps["step"].tolist() == list(range(40))
    assert (t.steps["has_logits"] == 1).all() and (t.steps["logits_argmax"] >= 0).all()


def test_steps_waiting_for_their_batch_reach_the_writer_once_the_model_goes_quiet(tmp_path):
    """On the CPU the model's thread emits steps in batches (graphlate.EMIT_BATCH); a run that
    stops stepping (idle, stalled, about to be killed) still has its last steps written
    within the flush interval, by the linger thread, without a close."""
    from capture_models import ids

    m = Tiny()
    with torch.no_grad(), qforensics.capture(m, tmp_path / "t.h5", flush_interval=0.05) as cap:
        for _ in range(3):  # fewer than a batch
            m(ids())
        assert cap._graph_late() is False and cap._drainer is None  # the CPU's own path
        deadline = time.monotonic() + 20
        while cap._writer.steps_written < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cap._writer.steps_written == 3
        m(ids())  # and the run goes on after it
    with qforensics.open_trace(tmp_path / "t.h5") as t:
        assert t.n_steps == 4 and t.end.complete
