"""In-place safety with vLLM's real in-place kernel: `fused_add_rms_norm` (vLLM's C++ op, the
one its RMSNorm runs where that implementation is chosen) rewrites a linear's output after the
hook saw it. What the trace holds for that output must be what the linear returned, as a plain
hook's copy taken at call time says, not the normalized values the kernel left behind; and the
next layer's input, the same tensor object after the kernel, must hold those."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qforensics.hooks.capture import Capture
from qforensics.trace.reader import open_trace

pytestmark = pytest.mark.vllm


class _Runner:  # no scheduler output: each forward is a warm-up-flagged step
    pass


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.o_proj = nn.Linear(64, 64, bias=False)
        self.down_proj = nn.Linear(64, 64, bias=False)
        with torch.no_grad():
            self.o_proj.weight.copy_(torch.randn(64, 64, generator=g) * 3)
            self.down_proj.weight.copy_(torch.randn(64, 64, generator=g) * 0.1)
        self.norm_w = torch.ones(64)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        import vllm._custom_ops as ops

        h = self.o_proj(x)
        ops.fused_add_rms_norm(h, residual, self.norm_w, 1e-6)  # h, residual rewritten in place
        return self.down_proj(h)


def _record(path, name, io):
    with open_trace(path) as t:
        mid = list(t.modules["name"]).index(name)
        r = t.records(0)
        return r[(r["module_id"] == mid) & (r["io"] == io)].iloc[0]


def _session(kind):
    if kind == "vllm":
        from qforensics.engines.vllm_capture import vllm_capture

        runner = _Runner()
        return lambda model, path: vllm_capture(model, path, runner=runner)
    return Capture


@pytest.mark.parametrize("kind", ["vllm", "plain"])
def test_records_each_tensor_as_its_hook_saw_it(tmp_path, kind):
    torch.manual_seed(1)
    model = _Block()
    x, res = torch.randn(16, 64), torch.randn(16, 64)
    seen = {}

    def keep_out(m, a, o):  # plain hooks' copies at call time (return None: output unchanged)
        seen["o_proj.out"] = o.clone()

    def keep_in(m, a):
        seen["down_proj.in"] = a[0].clone()

    hs = [model.o_proj.register_forward_hook(keep_out),
          model.down_proj.register_forward_pre_hook(keep_in)]
    path = tmp_path / "t.h5"
    with torch.inference_mode():  # as vLLM runs: no version counters to notice the change
        cap = _session(kind)(model, path)
        cap.attach()
        model(x, res)
        cap.close()
    for h in hs:
        h.remove()
    o, d = seen["o_proj.out"], seen["down_proj.in"]
    # the kernel really rewrote the same tensor: o_proj's output became the norm's output
    assert float(o.abs().max()) > 20 and float(d.abs().max()) < float(o.abs().max()) / 4
    for (name, io), want in ((("o_proj", 1), o), (("down_proj", 0), d)):
        rec = _record(path, name, io)
        assert float(rec["absmax"]) == pytest.approx(float(want.abs().max()), rel=1e-6)
        assert float(rec["min"]) == pytest.approx(float(want.min()), rel=1e-6)
        assert float(rec["std"]) == pytest.approx(float(want.std(unbiased=False)), rel=1e-4)
