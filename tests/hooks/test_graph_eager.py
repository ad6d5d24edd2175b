"""Compiled mode's hooks run eagerly (`capture(model, compiled=True)` on a model that is not
compiled, or a module Dynamo falls back on): each tensor's figures must be those its hook saw,
even when the model changes it in place later in the same decoder block (as vLLM's fused
add-RMSNorm does to its input). Expectations come from plain forward hooks that copy the
tensors when they run; nothing is taken from qforensics' output."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import qforensics
from qforensics.trace import schema


class MutatingBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, d)
        self.down = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h.mul_(3.0).add_(100.0)  # up's output, after up's hook
        y = self.down(h)
        h.zero_()  # down's input, after down's hook
        return y + x


class Blocks(nn.Module):
    def __init__(self, d: int = 8, n: int = 2) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.layers = nn.ModuleList([MutatingBlock(d) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_eager_calls_of_compiled_hooks_record_what_each_hook_saw(tmp_path):
    m = Blocks()
    x = torch.randn(1, 5, 8)
    seen: dict[tuple[str, int], np.ndarray] = {}
    handles = []
    for name, mod in m.named_modules():
        if isinstance(mod, nn.Linear):
            def hook(mod, args, out, name=name):  # noqa: ANN001, ANN202
                seen[(name, schema.IO_INPUT)] = args[0].detach().double().numpy().copy()
                seen[(name, schema.IO_OUTPUT)] = out.detach().double().numpy().copy()
            handles.append(mod.register_forward_hook(hook))
    with torch.no_grad():
        m(x.clone())
    for h in handles:
        h.remove()
    path = tmp_path / "t.h5"
    with torch.no_grad(), qforensics.capture(m, path, compiled=True) as cap:
        m(x.clone())
        assert cap.degraded is None
    with qforensics.open_trace(path) as t:
        assert t.meta["status"]["capture_mode"] == "compiled"
        recs = t.records(0)
        assert len(seen) == 8
        for (name, io), arr in seen.items():
            r = recs[(recs["module"] == name) & (recs["io"] == io)].iloc[0]
            flat = arr.reshape(-1, arr.shape[-1])
            np.testing.assert_allclose(r["min"], flat.min(), rtol=1e-6, err_msg=name)
            np.testing.assert_allclose(r["max"], flat.max(), rtol=1e-6, err_msg=name)
            np.testing.assert_allclose(r["mean"], flat.mean(), rtol=1e-4, atol=1e-5)
            cmin, cmax = t.channel_ranges(r)
            np.testing.assert_allclose(cmax, flat.max(0), rtol=1e-6, err_msg=name)
