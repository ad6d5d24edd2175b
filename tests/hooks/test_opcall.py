"""The stats op's eager CPU calls without the dispatcher (hooks/opcall.py, opcall.c): an eager
hook on the op path hands its tensors to an OpCall first, which reduces them with the op
kernel's own function, and to the op when there is more to do. Expectations: the same capture
with the lane off (every call through the op, whose kernel test_statsop checks against numpy),
and numpy over the tensors a plain hook saw; never the lane's own output."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import qforensics
from qforensics.hooks import fused, opcall, statscpu, statsnative  # noqa: F401 - loads the kernel
from qforensics.trace import schema

pytestmark = pytest.mark.skipif(statsnative.KERNEL.get("kernel") != "c++",
                                reason="the lane runs only beside the op's C++ CPU kernel")


@pytest.fixture(autouse=True)
def _built():
    fused.REDUCER.ready()  # starts its build where this cache folder has none
    fused.REDUCER.wait()
    opcall.LANE.wait()
    if opcall.LANE.off is not None:
        pytest.fail(f"opcall.c did not build: {opcall.LANE.off}")


class Net(nn.Module):
    def __init__(self, d: int = 24, n: int = 3, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(n)])
        self.out = nn.Linear(d, 40)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.out(x)


def _run(tmp_path, name: str, lane: bool, dtype: torch.dtype, poison_at: int | None = None,
         steps: int = 6):
    off = opcall.LANE.off
    opcall.LANE.off = None if lane else "test: lane off"
    m = Net(dtype=dtype)
    xs = [torch.randn(1, 3 + (s % 2), 24).to(dtype) for s in range(steps)]
    try:
        with torch.no_grad(), qforensics.capture(m, tmp_path / name, compiled=True) as cap:
            for s, x in enumerate(xs):
                if s == poison_at:
                    m.layers[1].weight[2, :] = float("nan")  # in place, mid-run
                m(x)
            assert cap.degraded is None
    finally:
        opcall.LANE.off = off
    t = qforensics.open_trace(tmp_path / name)
    return t, xs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lane_writes_the_records_the_op_writes(tmp_path, dtype):
    a, _ = _run(tmp_path, "lane.h5", True, dtype)
    b, _ = _run(tmp_path, "op.h5", False, dtype)
    with a, b:
        assert a.meta["status"]["capture_mode"] == "compiled"
        calls = a.meta["status"]["graph_eager_calls"]
        assert calls["c"] > 0 and calls["op"] == 0  # every call finished by its OpCall
        assert "graph_eager_calls" not in b.meta["status"]
        assert a.n_steps == b.n_steps == 6
        for step in range(6):
            ra, rb = a.records(step), b.records(step)
            assert len(ra) == len(rb) > 0
            for col in ra.columns:
                np.testing.assert_array_equal(ra[col].to_numpy(), rb[col].to_numpy(),
                                              err_msg=f"step {step} {col}")
            for k in range(len(ra)):
                ca, cb = a.channel_ranges(ra.iloc[k]), b.channel_ranges(rb.iloc[k])
                for u, v in zip(ca, cb):
                    np.testing.assert_array_equal(u, v)
            _same_token_maxima(a, b, ra, rb)


def _same_token_maxima(a, b, ra, rb) -> None:
    """Each record's per-token absmax (/tokens/absmax), which the record table only points
    to: the same values in both traces, and some there at all."""
    kept = ra["tok_count"].to_numpy() > 0
    assert kept.any()
    for k in np.nonzero(kept)[0]:
        ta = a.token_span(int(ra["tok_offset"].iloc[k]),
                          int(ra["tok_offset"].iloc[k] + ra["tok_count"].iloc[k]))
        tb = b.token_span(int(rb["tok_offset"].iloc[k]),
                          int(rb["tok_offset"].iloc[k] + rb["tok_count"].iloc[k]))
        np.testing.assert_array_equal(ta, tb)


def test_the_lane_figures_are_numpys(tmp_path):
    seen = {}
    m = Net()
    h = m.layers[0].register_forward_hook(
        lambda mod, args, out: seen.update(x=args[0].double().numpy().copy()))
    with torch.no_grad():
        x = torch.randn(1, 3, 24)
        m(x)
    h.remove()
    with torch.no_grad(), qforensics.capture(m, tmp_path / "t.h5", compiled=True):
        m(x)
    with qforensics.open_trace(tmp_path / "t.h5") as t:
        assert t.meta["status"]["graph_eager_calls"]["op"] == 0
        r = t.records(0)
        r = r[(r["module"] == "layers.0") & (r["io"] == schema.IO_INPUT)].iloc[0]
        flat = seen["x"].reshape(-1, 24)
        np.testing.assert_allclose([r["min"], r["max"]], [flat.min(), flat.max()], rtol=1e-6)
        np.testing.assert_allclose(r["mean"], flat.mean(), rtol=1e-5, atol=1e-6)
        cmin, cmax = t.channel_ranges(r)
        np.testing.assert_allclose(cmin, flat.min(0), rtol=1e-6)
        np.testing.assert_allclose(cmax, flat.max(0), rtol=1e-6)


def test_a_nan_goes_to_the_op_and_is_found_as_the_op_finds_it(tmp_path):
    a, _ = _run(tmp_path, "lane.h5", True, torch.float32, poison_at=3)
    b, _ = _run(tmp_path, "op.h5", False, torch.float32, poison_at=3)
    with a, b:
        calls = a.meta["status"]["graph_eager_calls"]
        assert calls["op"] > 0 and calls["c"] > 0  # the poisoned steps' calls went to the op
        fa = a.meta["status"]["graph_first_nonfinite"]
        assert fa == b.meta["status"]["graph_first_nonfinite"]
        assert fa["step"] == 3
        assert a.meta["status"]["snapshot_compiled"] == b.meta["status"]["snapshot_compiled"]
        for step in range(6):
            ra, rb = a.records(step), b.records(step)
            for col in ra.columns:
                np.testing.assert_array_equal(ra[col].to_numpy(), rb[col].to_numpy(),
                                              err_msg=f"step {step} {col}")
            _same_token_maxima(a, b, ra, rb)
    from qforensics.analyze.analyzer import analyze_trace

    f = analyze_trace(tmp_path / "lane.h5")
    assert f.status == "FAILED" and f.first_nonfinite is not None
    assert f.first_nonfinite.step == 3 and f.first_nonfinite.module == "layers.1"


def _op_call(m: int = 1):
    gs_ring = torch.zeros(4, 64)
    toks = torch.zeros(4, 8, 4)
    step = torch.zeros((), dtype=torch.int64)
    fn = opcall.LANE.op_call_type()
    import ctypes

    group = int(ctypes.cast(fused.REDUCER.group(), ctypes.c_void_p).value)
    call = fn(group, gs_ring.data_ptr(), 4, 64, toks.data_ptr(), 4, 8, 4, toks.stride(0),
              step.data_ptr(), 1 << 20, tuple(range(m)), tuple(9 + 20 * i for i in range(m)),
              (4,) * m, (8,) * m, opcall.DTYPES, (gs_ring, toks, step))
    return call, gs_ring, step


def test_what_the_lane_leaves_to_the_op():
    call, ring, step = _op_call()
    assert call([torch.ones(2, 4)]) is True
    step.fill_(2)
    assert call([torch.arange(8.0).reshape(2, 4)]) is True
    row = ring[2, 9:18]  # sum, sum of squares, min, max, 0, 0, rows, channels, stamp
    assert row.tolist() == [28.0, 140.0, 0.0, 7.0, 0.0, 0.0, 2.0, 4.0, 2.0]
    assert call([torch.ones(4, 2).t()]) is False  # strided
    assert call([torch.ones(2, 4, dtype=torch.float16)]) is False  # a dtype qf_group lacks
    assert call([torch.tensor([[1.0, float("nan"), 0.0, 0.0]])]) is False  # the exact pass
    assert call([torch.ones(0, 4)]) is False  # no rows
    assert call([torch.ones(2, 4), torch.ones(2, 4)]) is False  # not this call site's count
    assert (call.fast, call.slow) == (2, 5)
    two, _, _ = _op_call(2)
    x = torch.ones(2, 4)
    assert two([x, x]) is False  # a tensor given twice: the op copies the repeat
    with pytest.raises(TypeError):
        call()  # one list of tensors, nothing else
