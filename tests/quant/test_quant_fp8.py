"""FP8 e4m3/e5m2 fake-quant: grid rounding, relative error, saturation vs NaN, the cast probe."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from qforensics.quant import FP8_FORMATS, fake_quant_fp8, probe_fp8_cast, round_to_fp8_grid

FMTS = ["e4m3", "e5m2"]
arrays = hnp.arrays(
    np.float32,
    hnp.array_shapes(min_dims=1, max_dims=2, min_side=1, max_side=50),
    elements=st.floats(-2e5, 2e5, width=32, allow_nan=False, allow_subnormal=True),
)


@settings(max_examples=80, deadline=None, database=None)
@given(arr=arrays, fmt=st.sampled_from(FMTS))
def test_nosat_nan_exactly_where_out_of_range(arr: np.ndarray, fmt: str) -> None:
    x = torch.from_numpy(arr)
    spec = FP8_FORMATS[fmt]
    q = fake_quant_fp8(x, fmt, saturate=False)
    assert torch.equal(torch.isnan(q), x.abs() > spec.max)
    qs = fake_quant_fp8(x, fmt, saturate=True)
    assert not torch.isnan(qs).any()
    assert torch.all(qs.abs() <= spec.max)
    inside = x.abs() <= spec.max
    assert torch.equal(q[inside], qs[inside])
    # in-range relative error: half an FP8 ulp (absolute half-ulp of the subnormal grid below)
    m = spec.mantissa_bits
    bound = torch.maximum(x.abs().double() * 2.0 ** -(m + 1),
                          torch.tensor(spec.min_subnormal / 2, dtype=torch.float64))
    err = (x.double() - qs.double()).abs()
    assert torch.all(err[inside] <= bound[inside])
    assert torch.all(qs[x.abs() > spec.max].abs() == spec.max)
    assert torch.all(qs[x == 0] == 0)


@settings(max_examples=40, deadline=None, database=None)
@given(arr=arrays, fmt=st.sampled_from(FMTS))
def test_grid_matches_torch_cast_in_range(arr: np.ndarray, fmt: str) -> None:
    spec = FP8_FORMATS[fmt]
    x = torch.from_numpy(arr).clamp(-spec.max, spec.max)
    dtype = getattr(torch, spec.torch_dtype, None)
    if dtype is None:
        pytest.skip("this torch has no FP8 dtypes")
    assert torch.equal(round_to_fp8_grid(x, fmt), x.to(dtype).to(torch.float32))


def test_known_grid_points_and_ties() -> None:
    x = torch.tensor([448.0, 449.0, 464.0, 17.0, 8.5, 0.001953125, 0.0009765625, -0.0])
    q = round_to_fp8_grid(x, "e4m3")
    # 464 is halfway between 448 and 480 -> even mantissa (448); 17 -> 16 (ulp 2, tie->even);
    # 8.5 -> 8 (tie to even), 2**-9 is the smallest subnormal, 2**-10 ties to 0
    assert q.tolist() == [448.0, 448.0, 448.0, 16.0, 8.0, 0.001953125, 0.0, -0.0]
    assert round_to_fp8_grid(torch.tensor([57344.0, 3.0, 4.5, 9.0]), "e5m2").tolist() == [
        57344.0, 3.0, 4.0, 8.0]


def test_infinities_and_nan() -> None:
    x = torch.tensor([float("inf"), float("-inf"), float("nan"), 1.0])
    s = fake_quant_fp8(x, "e4m3", saturate=True)
    assert s[:2].tolist() == [448.0, -448.0] and math.isnan(s[2]) and s[3] == 1.0
    n = fake_quant_fp8(x, "e4m3", saturate=False)
    assert torch.isnan(n[:3]).all() and n[3] == 1.0


def test_scales() -> None:
    x = torch.tensor([3000.0, -1.0, 0.5, 0.0])
    assert torch.isnan(fake_quant_fp8(x, "e4m3", saturate=False)[0])
    d = fake_quant_fp8(x, "e4m3", saturate=False, scale="dynamic")
    assert not torch.isnan(d).any() and d[0] == 3000.0 and d[3] == 0
    assert torch.equal(fake_quant_fp8(torch.zeros(4), "e5m2", scale="dynamic"), torch.zeros(4))
    s = fake_quant_fp8(x, "e4m3", saturate=False, scale=10.0)
    assert not torch.isnan(s).any() and s[0] == 2880.0  # 300 -> 288 (step 32)
    with pytest.raises(ValueError):
        fake_quant_fp8(x, "e4m3", scale=0.0)
    with pytest.raises(ValueError):
        fake_quant_fp8(x, "e3m4")  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_dtype_preserved(dtype: torch.dtype) -> None:
    x = (torch.randn(4, 16) * 300).to(dtype)
    q = fake_quant_fp8(x, "e4m3", saturate=False)
    assert q.dtype == dtype
    assert torch.equal(torch.isnan(q), x.float().abs() > 448)


def test_probe_fp8_cast_shape() -> None:
    r = probe_fp8_cast()
    assert r["torch"] == torch.__version__
    assert set(r["e4m3fn"]) == {"1000.0", "-1000.0", "inf"}
    assert set(r["e5m2"]) == {"100000.0", "-100000.0", "inf"}
    for fmt, dt in (("e4m3fn", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        for label, v in r[fmt].items():  # each answer is what this torch's cast really gives
            out = torch.tensor([float(label)]).to(dt).float().item()
            want = ("nan" if out != out else "saturate" if abs(out) == torch.finfo(dt).max
                    else f"other:{out!r}")
            assert v == want, (fmt, label, v, out)


def test_probe_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch, "float8_e5m2")
    r = probe_fp8_cast()
    assert set(r["e5m2"].values()) == {"unsupported"}
