"""Compiled mode's lazy channel ranges (hooks/ringranges.py): a ring step's per-channel
minima and maxima stay in the stats op's ring until a batch needs them, are copied out at
most once, never when a later step replaced them in the file's ring, and never read from a
slot the op has moved past."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import qforensics
from qforensics.hooks import graphhooks, graphstats
from qforensics.hooks.ringranges import LazyTracker, SlotRanges
from qforensics.trace import schema

from capture_models import Tiny, greedy_tokens


def _lazy_mlp(slots: int):
    torch.manual_seed(3)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    gs = graphstats.GraphStats(entries=8, tok_rows=8, device=torch.device("cpu"),
                               channel_limit=8192, channel_io="all", slots=slots, lazy=True)
    for mid, mod in enumerate((m[0], m[2])):
        mod.register_forward_hook(graphhooks.make_hook(gs, mid, False, 64, 4, 2),
                                  with_kwargs=True)
    return m, gs


def _run(m, gs, step: int) -> tuple[dict, torch.Tensor]:
    x = torch.randn(5, 16)
    gs.begin(step)
    with torch.no_grad():
        m(x)
    return gs.collect(step, 0, True), x


def test_lazy_ranges_read_the_slot_once_and_match_the_tensor():
    m, gs = _lazy_mlp(slots=3)
    part, x = _run(m, gs, 0)
    cmin, cmax = part["cmin"], part["cmax"]
    assert isinstance(cmin.src, SlotRanges) and cmin.src.pending  # nothing copied yet
    rec = part["records"]
    assert len(cmin) == int(rec["channels"][rec["chan_offset"] >= 0].sum())
    a = np.asarray(cmin)  # copied now, from the slot
    assert not cmin.src.pending and np.asarray(cmin) is a  # once
    first = rec[(rec["module_id"] == 0) & (rec["io"] == schema.IO_INPUT)][0]
    o, w = int(first["chan_offset"]), int(first["channels"])
    np.testing.assert_allclose(a[o:o + w], x.amin(0).numpy(), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(cmax)[o:o + w], x.amax(0).numpy(), rtol=1e-6)


def test_a_slot_the_op_moved_past_reads_lost_never_as_data():
    m, gs = _lazy_mlp(slots=2)
    part, _ = _run(m, gs, 0)
    _run(m, gs, 1)
    _run(m, gs, 2)  # slot 0 again: step 0's stamps are gone
    assert part["cmin"].resolve() is None
    assert gs.ranges_lost == 1


def test_tracker_drops_a_step_a_later_one_replaced_and_copies_one_still_needed():
    m, gs = _lazy_mlp(slots=12)
    tr = LazyTracker(horizon=5, file_slots=4)
    parts = {}
    for step in range(10):
        tr.advance(step)
        parts[step], _ = _run(m, gs, step)
        if step != 5:  # step 5 is kept for good (no ring step), step 1 keeps its file slot
            tr.note_ring(step, parts[step]["cmin"])
    # by step 9 steps 0-4 were resolved, each 5 steps after its own: 0, 2, 3, 4 had been
    # replaced in their file slots by 4, 6, 7, 8; step 1 by nothing (5 was kept): copied
    state = {s: parts[s]["cmin"].src._state for s in range(5)}
    assert state == {0: "dropped", 1: "read", 2: "dropped", 3: "dropped", 4: "dropped"}, state
    assert tr.dropped == 4
    assert all(parts[s]["cmin"].src.pending for s in (6, 7, 8, 9))


def test_compiled_trace_ring_holds_the_eager_ranges_and_copied_only_those(tmp_path):
    """14 steps, a ring of 4, one write at close: the file's ring holds steps 10-13, their
    ranges equal to the eager capture's of the same model; steps 1-8 were never copied
    (each replaced in its file slot by step + 4 before the horizon of 5 steps)."""
    kw = {"ring_steps": 4, "trigger_window": 2, "flush_interval": 600.0}
    n = 14
    toks_e = greedy_tokens(Tiny(), tmp_path / "e.h5", n, **kw)
    toks_c = greedy_tokens(torch.compile(Tiny(), dynamic=True), tmp_path / "c.h5", n, **kw)
    assert toks_c == toks_e
    te, tc = qforensics.open_trace(tmp_path / "e.h5"), qforensics.open_trace(tmp_path / "c.h5")
    st = tc.meta["status"]
    assert st["graph_ranges"] == {"lazy": True, "never_copied": n - 1 - 4 - 1, "lost": 0}
    names = [str(x) for x in te.module_columns["name"]][:-1]  # the root's logits: not here
    checked = 0
    for step in range(10, n):
        for name in names:
            a = te.channels_for(name, step)
            b = tc.channels_for(name, step)
            assert (a is None) == (b is None), (name, step)
            if a is not None:
                np.testing.assert_allclose(b[0], a[0], rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(b[1], a[1], rtol=1e-5, atol=1e-6)
                checked += 1
    assert checked >= 4 * 3
    # an older ring step is not in the file's ring of either trace
    assert te.channels_for(names[0], 5) is None and tc.channels_for(names[0], 5) is None
