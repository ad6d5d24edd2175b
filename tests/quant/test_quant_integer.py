"""INT4/INT8 RTN fake-quant: error bounds, zeros, scales, group tails, the per-tensor failure."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from qforensics.quant import QuantSchemeError, fake_quant_int, int_qmax, int_scales

GRANS = [("per-tensor", None), ("per-channel", None), ("per-token", None),
         ("group", 32), ("group", 64), ("group", 128), ("group", 5)]

finite32 = st.floats(-1e6, 1e6, width=32, allow_nan=False, allow_subnormal=True)
matrices = hnp.arrays(
    np.float32,
    hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=40),
    elements=finite32,
)


def _expand(scales: torch.Tensor, x: torch.Tensor, gran: str, gs: int | None) -> torch.Tensor:
    """Scale of each element of x, same shape as x."""
    if gran == "per-tensor" or x.dim() == 0:
        return scales.expand(x.shape)
    if gran == "group":
        return scales.repeat_interleave(gs, dim=-1)[..., : x.shape[-1]]
    return scales.unsqueeze(-1).expand(x.shape)


@settings(max_examples=60, deadline=None, database=None)
@given(arr=matrices, bits=st.sampled_from([4, 8]), g=st.sampled_from(GRANS))
def test_round_trip_within_half_scale(arr: np.ndarray, bits: int, g: tuple) -> None:
    gran, gs = g
    x = torch.from_numpy(arr)
    q = fake_quant_int(x, bits, gran, gs)
    s = int_scales(x, bits, gran, gs)
    assert q.dtype == x.dtype and q.shape == x.shape
    assert torch.all(s > 0)
    per_elem = _expand(s, x, gran, gs)
    err = (x.double() - q.double()).abs()
    assert torch.all(err <= per_elem.double() * 0.5 * (1 + 1e-5) + 1e-44)
    # on the grid: q / scale is an integer within [-qmax, qmax]
    k = torch.round(q.double() / per_elem.double())
    assert torch.all(k.abs() <= int_qmax(bits))
    # exact zeros stay zero; no NaN from finite input
    assert torch.all(q[x == 0] == 0)
    assert not torch.isnan(q).any()


@pytest.mark.parametrize("gran,gs", GRANS)
@pytest.mark.parametrize("bits", [4, 8])
def test_all_zero_group_gives_zeros_never_nan(gran: str, gs: int | None, bits: int) -> None:
    x = torch.randn(6, 70)
    x[2] = 0.0  # a zero row (zero channel / token)
    x[:, :32] = 0.0  # a zero group in every row
    if gran == "per-tensor":
        x = torch.zeros(6, 70)
    q = fake_quant_int(x, bits, gran, gs)
    assert not torch.isnan(q).any()
    assert torch.all(q[x == 0] == 0)
    assert torch.all(int_scales(x, bits, gran, gs) > 0)


def test_scales_never_zero_even_for_subnormal_absmax() -> None:
    x = torch.tensor([[1e-45, 0.0, -1e-45], [0.0, 0.0, 0.0]], dtype=torch.float32)
    s = int_scales(x, 4, "per-channel")
    assert torch.all(s > 0)
    q = fake_quant_int(x, 4, "per-channel")
    assert torch.all(torch.isfinite(q))


def test_group_tail_uses_its_own_scale() -> None:
    # K = 70 with g32: groups [0:32], [32:64], tail [64:70] (6 elements)
    x = torch.full((2, 70), 100.0)
    x[:, 64:] = torch.tensor([0.1, -0.2, 0.3, 0.05, -0.07, 0.7])
    s = int_scales(x, 4, "group", 32)
    assert s.shape == (2, 3)
    assert torch.allclose(s[:, 2], torch.full((2,), 0.7 / 7))
    q = fake_quant_int(x, 4, "group", 32)
    assert torch.all((q[:, 64:] - x[:, 64:]).abs() <= 0.05 + 1e-7)
    assert (q[:, 64:] != 0).sum() >= 10  # the tail is not wiped out by the big groups
    # a tensor shorter than one group is one tail group
    y = torch.tensor([[1.0, -2.0, 3.5]])
    assert int_scales(y, 8, "group", 128).shape == (1, 1)


def test_group_matches_reference_loop() -> None:
    torch.manual_seed(1)
    x = torch.randn(4, 77)
    q = fake_quant_int(x, 4, "group", 32)
    ref = torch.empty_like(x)
    for r in range(4):
        for start in range(0, 77, 32):
            g = x[r, start : start + 32]
            s = g.abs().max() / 7
            ref[r, start : start + 32] = torch.clamp(torch.round(g / s), -7, 7) * s
    assert torch.equal(q, ref)


def test_per_tensor_int4_outlier_channel_zeroes_the_rest() -> None:
    """The failure mode: one huge input channel makes per-tensor INT4 erase everything else."""
    torch.manual_seed(0)
    w = torch.randn(64, 256) * 0.05
    w[:, 17] = 1000.0
    q = fake_quant_int(w, 4, "per-tensor")
    others = torch.ones(256, dtype=torch.bool)
    others[17] = False
    assert (q[:, others] == 0).float().mean() > 0.99
    assert torch.allclose(q[:, 17], w[:, 17])
    # group-wise confines the damage to the outlier's group
    qg = fake_quant_int(w, 4, "group", 32)
    assert (qg[:, 32:] == 0).float().mean() < 0.5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dtype_preserved(dtype: torch.dtype) -> None:
    x = torch.randn(3, 40).to(dtype)
    for gran, gs in GRANS:
        q = fake_quant_int(x, 8, gran, gs)
        assert q.dtype == dtype and q.device == x.device
        assert torch.allclose(q.double(), x.double(), atol=0.05, rtol=0.02)


def test_deterministic_and_empty() -> None:
    x = torch.randn(5, 33)
    assert torch.equal(fake_quant_int(x, 4, "group", 16), fake_quant_int(x, 4, "group", 16))
    e = torch.empty(0, 8)
    assert fake_quant_int(e, 4, "per-channel").shape == (0, 8)


def test_non_finite_input_is_not_hidden() -> None:
    x = torch.tensor([[1.0, float("nan"), 2.0], [1.0, 2.0, 3.0]])
    q = fake_quant_int(x, 8, "per-channel")
    assert torch.isnan(q[0]).all() and torch.isfinite(q[1]).all()


def test_bad_arguments() -> None:
    x = torch.randn(2, 4)
    with pytest.raises(QuantSchemeError):
        fake_quant_int(x, 3)
    with pytest.raises(QuantSchemeError):
        fake_quant_int(x, 4, "group", 0)
    with pytest.raises(QuantSchemeError):
        fake_quant_int(x, 4, "per-row")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        fake_quant_int(torch.ones(2, 2, dtype=torch.int32), 4)
