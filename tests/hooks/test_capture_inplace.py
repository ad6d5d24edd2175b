"""Statistics describe each tensor as its hook saw it, even when the model changes it in place
afterwards. Expectations come from an independent plain forward hook that copies the tensors
when it runs; nothing is taken from qforensics' own output."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import qforensics
from qforensics.trace import schema


class MutatesAfterHook(nn.Module):
    """a's output and input are both changed in place after a's hook ran."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.mul_(3.0).add_(100.0)  # a's output, after a's hook
        y = self.b(h)
        x.mul_(-2.0)  # a's input, after both hooks
        return y


def plain_expectations(model: nn.Module, x: torch.Tensor) -> dict:
    """Run once with plain hooks that copy inputs/outputs at hook time."""
    seen: dict[tuple[str, int], np.ndarray] = {}
    handles = []
    for name in ("a", "b"):
        def hook(mod, args, out, name=name):
            seen[(name, schema.IO_INPUT)] = args[0].detach().double().numpy().copy()
            seen[(name, schema.IO_OUTPUT)] = out.detach().double().numpy().copy()
        handles.append(getattr(model, name).register_forward_hook(hook))
    try:
        model(x.clone())
    finally:
        for h in handles:
            h.remove()
    return seen


@pytest.mark.parametrize("rows", [3, 5000])
@pytest.mark.parametrize("inference", [False, True])
def test_stats_are_those_the_hook_saw(tmp_path, rows, inference):
    m = MutatesAfterHook()
    x = torch.randn(1, rows, 16)
    want = plain_expectations(m, x)
    path = tmp_path / "t.h5"
    with torch.inference_mode(inference), qforensics.capture(m, path):
        m(x.clone())
    with qforensics.open_trace(path) as t:
        recs = t.records(0)
        for (name, io), arr in want.items():
            r = recs[(recs["module"] == name) & (recs["io"] == io)].iloc[0]
            flat = arr.reshape(-1, arr.shape[-1])
            np.testing.assert_allclose(r["min"], flat.min(), rtol=1e-6)
            np.testing.assert_allclose(r["max"], flat.max(), rtol=1e-6)
            np.testing.assert_allclose(r["mean"], flat.mean(), rtol=1e-4, atol=1e-5)
            # the fast pass keeps float32 sum and sum of squares, and the host derives
            # var = sumsq/n - mean^2: rounding sumsq costs about eps32 * (mean^2 + var) / var of
            # the variance (b's input has mean ~100 and std ~1.5), half that on the std
            cancel = 4 * np.finfo(np.float32).eps * (flat.mean() ** 2 + flat.var()) / flat.var()
            np.testing.assert_allclose(r["std"], flat.std(), rtol=max(1e-4, cancel))
            cmin, cmax = t.channel_ranges(r)
            np.testing.assert_allclose(cmin, flat.min(0), rtol=1e-6)
            np.testing.assert_allclose(cmax, flat.max(0), rtol=1e-6)
            np.testing.assert_allclose(t.token_absmax(r), np.abs(flat).max(1), rtol=1e-6)


def test_nonfinite_counts_are_those_the_hook_saw(tmp_path):
    """A NaN the hook saw, overwritten in place afterwards, is still counted (exact pass on
    the hook-time copy)."""

    class Hides(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x):
            h = self.a(x)
            h[0, 0, 1] = float("nan")
            h = self.b(h)  # b's input holds the NaN when b's hook runs
            out = self.b(torch.nan_to_num(h))
            h.zero_()  # b's first output, after its hook
            return out

    m = Hides()
    x = torch.randn(1, 2, 4)
    path = tmp_path / "t.h5"
    with qforensics.capture(m, path):
        m(x)
    with qforensics.open_trace(path) as t:
        recs = t.records(0)
        b_first = recs[recs["module"] == "b"].sort_values("call_index")
        b_in = b_first[b_first["io"] == schema.IO_INPUT].iloc[0]
        b_out = b_first[b_first["io"] == schema.IO_OUTPUT].iloc[0]
        assert b_in["nan_count"] == 1
        assert b_out["nan_count"] == 4  # row 0 of a 4-wide linear's output (NaN spreads)
        assert np.isfinite(b_out["min"]) and np.isfinite(b_out["max"])


@pytest.mark.parametrize("rows", [3, 5000])
@pytest.mark.parametrize("inference", [False, True])
def test_repeated_steps_see_what_each_hook_saw(tmp_path, inference, rows):
    """Steps that repeat the first one (the eager hooks' op calls then reuse the first step's
    plan: graphhooks `_eager_call`). Each step's stats are those of the tensors when the hooks
    saw them, although the model rewrites them in place right after; a NaN a hook saw at step
    4 and that is overwritten afterwards is still counted. Expectations from plain hooks that
    copy at hook time."""
    m = MutatesAfterHook()
    seen: dict[tuple[int, str, int], np.ndarray] = {}
    handles = []
    current = [0]  # the step being run
    for name in ("a", "b"):
        def hook(mod, args, out, name=name):
            step = current[0]
            seen[(step, name, schema.IO_INPUT)] = args[0].detach().double().numpy().copy()
            seen[(step, name, schema.IO_OUTPUT)] = out.detach().double().numpy().copy()
        handles.append(getattr(m, name).register_forward_hook(hook))
    torch.manual_seed(5)
    xs = [torch.randn(1, rows, 16) for _ in range(6)]
    if rows == 3:  # a's input at step 4: its hook sees the NaN, x.mul_ keeps it
        xs[4][0, 1, 7] = float("nan")
    path = tmp_path / "t.h5"
    with torch.inference_mode(inference), qforensics.capture(m, path):
        for i, x in enumerate(xs):
            current[0] = i
            m(x.clone())
    for h in handles:
        h.remove()
    with qforensics.open_trace(path) as t:
        assert t.n_steps == len(xs)
        for (step, name, io), arr in seen.items():
            recs = t.records(step)
            r = recs[(recs["module"] == name) & (recs["io"] == io)].iloc[0]
            flat = arr.reshape(-1, arr.shape[-1])
            fin = np.isfinite(flat)
            assert r["nan_count"] == int(np.isnan(flat).sum()), (step, name, io)
            f = flat[fin]
            np.testing.assert_allclose(r["min"], f.min(), rtol=1e-6)
            np.testing.assert_allclose(r["max"], f.max(), rtol=1e-6)
            np.testing.assert_allclose(r["mean"], f.mean(), rtol=1e-4, atol=1e-5)
            if fin.all():
                cmin, cmax = t.channel_ranges(r)
                np.testing.assert_allclose(cmin, flat.min(0), rtol=1e-6)
                np.testing.assert_allclose(cmax, flat.max(0), rtol=1e-6)
                np.testing.assert_allclose(t.token_absmax(r), np.abs(flat).max(1), rtol=1e-6)
