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


def test_a_model_compiled_and_run_before_capture_is_recorded_whole(tmp_path):
    """Dynamo does not guard on a module's hooks (torch._dynamo.config
    .skip_nnmodule_hook_guards): a model compiled and run before capture attaches would keep
    its graph without the capture's hooks, and a second capture would reuse the first one's
    graph. Each capture of a compiled model starts from a fresh compile: every hooked module
    is recorded at every step, by the capture that is open."""
    import torch._dynamo

    from capture_models import Tiny

    torch._dynamo.reset()
    model = Tiny()
    comp = torch.compile(model, dynamic=True)
    seq = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        comp(seq)  # compiled and run, no capture yet
        for name in ("a.h5", "b.h5"):  # then two captures, one after the other
            with qforensics.capture(comp, tmp_path / name):
                comp(seq)
                comp(seq)
            with qforensics.open_trace(tmp_path / name) as t:
                assert t.meta["status"]["capture_mode"] == "compiled"
                assert t.meta["status"]["graph_recompiled"] is True
                names = list(t.module_columns["name"])
                for step in (0, 1):
                    got = {names[i] for i in t.records(step)["module_id"]}
                    assert {"layers.0", "layers.2", "head"} <= got, (name, step, got)
