"""Step plans (hooks/plan.py): a step that repeats an earlier one runs on that step's plan; a
step that stops matching it half-way (another call order, another shape, a tensor no longer
shared) is finished on the generic path. Either way every record is the tensor its hook saw,
with the call index of the call that saw it. Expectations come from plain hooks that log every
call in order and copy its tensors."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import qforensics
from qforensics.hooks.pending import PendingStep
from qforensics.trace import schema


class Branchy(nn.Module):
    """a, b, c; at `extra` steps an additional call of c between a and b; at `fresh` steps b
    reads a copy of a's input instead of a's input itself (sharing changes)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.c = nn.Linear(d, d)
        self.extra: set[int] = set()
        self.fresh: set[int] = set()
        self.t = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, self.t = self.t, self.t + 1
        h = self.a(x)
        if t in self.extra:
            h = h + self.c(h)
        g = self.b(x.clone() if t in self.fresh else x)
        return self.c(h * g)


def logged_run(m: nn.Module, xs: list[torch.Tensor], path, inference: bool
               ) -> tuple[list[tuple[int, str]], dict]:
    """Plain hooks: (step, module) per call in order, and each call's tensors."""
    calls: list[tuple[int, str]] = []
    seen: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    current = [0]
    handles = []
    for name in ("a", "b", "c"):
        def hook(mod, args, out, name=name):
            seen[len(calls)] = (args[0].detach().double().numpy().copy(),
                                out.detach().double().numpy().copy())
            calls.append((current[0], name))
        handles.append(getattr(m, name).register_forward_hook(hook))
    try:
        with torch.inference_mode(inference), qforensics.capture(m, path, compiled=False):
            for i, x in enumerate(xs):
                current[0] = i
                m(x)
    finally:
        for h in handles:
            h.remove()
    return calls, seen


@pytest.mark.parametrize("inference", [False, True])
def test_steps_that_leave_their_plan_record_what_each_hook_saw(tmp_path, inference):
    m = Branchy()
    m.extra = {3, 7}
    m.fresh = {5}
    torch.manual_seed(3)
    # step 6 has another sequence length: another plan key; step 8 repeats it
    xs = [torch.randn(1, 6 if i in (6, 8) else 4, 8) for i in range(10)]
    path = tmp_path / "t.h5"
    calls, seen = logged_run(m, xs, path, inference)
    root_calls = len(xs)  # the model's own output record: one call per step, after its hooks
    with qforensics.open_trace(path) as t:
        assert t.n_steps == len(xs)
        recs = [t.records(step) for step in range(len(xs))]
        assert int(t.steps["n_calls"].sum()) == len(calls) + root_calls
    allrec = pd.concat(recs)
    allrec = allrec[allrec["module"].isin(["a", "b", "c"])]
    order = sorted(allrec["call_index"].unique().tolist())
    # one recorded call per logged call, in the same order, with strictly increasing indices
    assert len(order) == len(calls)
    for k, ci in enumerate(order):
        grp = allrec[allrec["call_index"] == ci]
        assert {(int(s), n) for s, n in zip(grp["step"], grp["module"])} == {calls[k]}
        for _, r in grp.iterrows():
            arr = seen[k][int(r["io"])]
            flat = arr.reshape(-1, arr.shape[-1])
            np.testing.assert_allclose(r["min"], flat.min(), rtol=1e-6)
            np.testing.assert_allclose(r["max"], flat.max(), rtol=1e-6)
            np.testing.assert_allclose(r["mean"], flat.mean(), rtol=1e-4, atol=1e-5)
    with qforensics.open_trace(path) as t:
        for k, ci in enumerate(order):
            r = allrec[(allrec["call_index"] == ci) & (allrec["io"] == schema.IO_OUTPUT)]
            flat = seen[k][1].reshape(-1, 8)
            cmin, cmax = t.channel_ranges(r.iloc[0])
            np.testing.assert_allclose(cmin, flat.min(0), rtol=1e-6)
            np.testing.assert_allclose(cmax, flat.max(0), rtol=1e-6)


def test_leave_plan_hands_over_the_same_records_as_the_generic_path():
    """A plan that misses at its third take: the takes so far become generic records with the
    same call, module, io, slot and shared tensors as a step taken generically."""
    torch.manual_seed(0)
    x, y, z = torch.randn(1, 1, 8), torch.randn(1, 1, 8), torch.randn(1, 1, 8)
    takes = [(0, 1, 0, 0, x), (0, 1, 1, 0, y), (1, 2, 0, 0, x), (1, 2, 1, 0, z)]

    def run(p: PendingStep, first: int, seq) -> list:
        p.start("k", first)
        for ci, mid, io, slot, t in seq:
            p.take(first + ci, mid, io, slot, t)
        p.settle()
        meta, which, _ = p.record_arrays()
        return [(tuple(r), int(w)) for r, w in zip(meta.tolist(), which.tolist())]

    with torch.inference_mode():
        p = PendingStep()
        p.track, p.nograd = False, True
        p.n_mod = 3
        plain = run(p, 0, takes)
        p.learn()
        assert "k" in p.plans
        p.clear()
        assert run(p, 10, takes) == [((10 + c, m, io, s), w) for (c, m, io, s), w in
                                     [((r[0], r[1], r[2], r[3]), w) for r, w in plain]]
        p.clear()
        other = torch.randn(1, 1, 8)  # the third take reads another tensor: not shared
        seq = takes[:2] + [(1, 2, 0, 0, other)] + takes[3:]
        got = run(p, 20, seq)
        assert not p.on_plan and p.missed
        assert [r for r, _ in got] == [(20 + c, m, io, s) for c, m, io, s, _ in seq]
        # x, y, other, z: four tensors (the generic rule shares only identical inputs)
        assert [w for _, w in got] == [0, 1, 2, 3]
        plan, per_dev = p.reduce_on_device()
        host = np.concatenate([torch.cat(v).numpy() for v in per_dev.values()])
        assert len(host) == sum(row[-1] for row in plan)
