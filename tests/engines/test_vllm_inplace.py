"""In-place safety with vLLM's real in-place kernel: `fused_add_rms_norm` (vLLM's C++ op, the
one its RMSNorm runs where that implementation is chosen) rewrites a linear's output after the
hook saw it. What the trace holds for that output must be what the linear returned, as a plain
hook's copy taken at call time says, not the normalized values the kernel left behind."""

from __future__ import annotations

import numpy as np
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


def _record(path, name):
    with open_trace(path) as t:
        mid = list(t.modules["name"]).index(name)
        r = t.records(0)
        return r[(r["module_id"] == mid) & (r["io"] == 1)].iloc[0]


def _run(cap_cls, tmp_path, **kw):
    torch.manual_seed(1)
    model = _Block()
    x, res = torch.randn(16, 64), torch.randn(16, 64)
    seen = {}
    def keep(m, a, o):  # a plain hook's copy at call time (returns None: output unchanged)
        seen["o"] = o.clone()

    h = model.o_proj.register_forward_hook(keep)
    path = tmp_path / f"{cap_cls.__name__}.h5"
    with torch.inference_mode():
        cap = cap_cls(model, path, **kw)
        cap.attach()
        model(x, res)
        cap.close()
    h.remove()
    return _record(path, "o_proj"), seen["o"]


def test_vllm_capture_records_the_output_before_the_in_place_kernel(tmp_path):
    from qforensics.hooks.engines.vllm_capture import VllmCapture

    runner = _Runner()
    rec, o = _run(VllmCapture, tmp_path, runner=runner)
    assert float(rec["absmax"]) == pytest.approx(float(o.abs().max()), rel=1e-6)
    assert float(rec["max"]) == pytest.approx(float(o.max()), rel=1e-6)
    assert float(rec["std"]) == pytest.approx(float(o.std(unbiased=False)), rel=1e-4)
    assert float(o.abs().max()) > 20  # far from the ~unit range the norm leaves behind


def test_the_hazard_is_real_without_the_copy(tmp_path):
    """Control: the plain capture (reduction at the step's end, no version counters under
    inference mode) records the values the kernel wrote, not the linear's output."""
    rec, o = _run(Capture, tmp_path)
    assert float(rec["absmax"]) != pytest.approx(float(o.abs().max()), rel=1e-3)
    assert float(rec["absmax"]) < float(o.abs().max()) / 4
    assert np.isfinite(float(rec["absmax"]))
