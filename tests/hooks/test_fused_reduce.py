"""The one-pass end-of-step reduction (hooks/fused.py, fused_reduce.c) against numpy, and what
it leaves to the eager pass."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from qforensics.hooks import fused, reduce

def _expected(x: np.ndarray, keep: bool) -> np.ndarray:
    """reduce.fast_parts' documented layout, in float64 numpy (NaN propagates like torch's)."""
    g, rows, chans = x.shape
    x = x.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        s, q = x.sum((1, 2)), (x * x).sum((1, 2))
        if rows == 1:
            x2 = x.reshape(g, chans)
            out = [s, q, x2.min(1), x2.max(1)] + ([x2.reshape(-1)] if keep else [])
            return np.concatenate(out)
        tmax, tmin = x.max(2), x.min(2)
        tok = np.where(np.isnan(tmax) | np.isnan(tmin), np.nan, np.maximum(tmax, -tmin))
        mid = ([x.min(1).reshape(-1), x.max(1).reshape(-1)] if keep
               else [tmin.min(1), tmax.max(1)])
        return np.concatenate([s, q, *mid, tok.reshape(-1)])


def _close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=2e-5, atol=1e-4)


def _built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> fused.FusedReducer:
    """A reducer whose library was just built from source into tmp_path."""
    monkeypatch.setenv("QFORENSICS_CACHE_DIR", str(tmp_path))
    red = fused.FusedReducer()
    red.parts(torch.zeros(2, 3, 4), 3, 4, True)  # starts the build
    red.wait()
    assert red.off is None, red.off
    return red


# widths that are and are not multiples of the vector loop's 32 values, one past a 2048-value block
SHAPES = [(12, 8, 576), (1, 8, 576), (4, 3, 1536), (30, 1, 576), (1, 1, 49152), (5, 40, 192),
          (3, 5, 100), (2, 1, 37), (2, 7, 2100)]


def _portable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Build the library without AVX-512: the plain C loops instead of the intrinsics."""
    flags = fused.FLAGS + ("-mno-avx512f",)
    build, where = fused.build, fused.library_path
    monkeypatch.setattr(fused, "build", lambda *a, **k: build(*a, **{**k, "flags": flags}))
    monkeypatch.setattr(fused, "library_path",
                        lambda *a, **k: where(*a, **{**k, "flags": flags}))


@pytest.mark.parametrize("variant", ["native", "portable"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_reduction_matches_numpy(dtype: torch.dtype, variant: str, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QFORENSICS_CACHE_DIR", str(tmp_path))  # a fresh build, from source
    if variant == "portable":
        _portable(monkeypatch)
    red = fused.FusedReducer()
    gen = torch.Generator().manual_seed(0)
    cases = []
    for shape in SHAPES:
        for keep in (True, False):
            x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
            flat = x.view(-1)
            if shape[0] > 1:  # non-finite values in some tensors of the group only
                flat[7] = float("nan")
                flat[-3] = float("inf")
                flat[-5] = float("-inf")
            cases.append((x, keep))
    x0, keep0 = cases[0]
    assert red.parts(x0, x0.shape[1], x0.shape[2], keep0) is None  # eager while it builds
    red.wait()
    assert red.off is None, red.off
    assert list((tmp_path / "kernels").glob("fused_reduce-*.so"))
    with torch.inference_mode():
        for x, keep in cases:
            got = red.parts(x, x.shape[1], x.shape[2], keep)
            assert got is not None, red.eager_why
            _close(torch.cat(got).numpy(), _expected(x.float().numpy(), keep))
    assert red.fused_calls == len(cases)
    assert red.status()["reduction"] == "fused"


def test_what_the_kernel_does_not_take_goes_eager(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    red = _built(tmp_path, monkeypatch)
    x = torch.randn(4, 8, 64)
    assert red.parts(x[:, :, :32], 8, 32, True) is None  # not contiguous
    assert red.parts(x.half(), 8, 64, True) is None  # no fp16 kernel
    assert red.parts(x.double(), 8, 64, True) is None
    assert red.eager_why == {"not built yet": 1, "layout": 1, "dtype float16": 1,
                             "dtype float64": 1}
    off = fused.FusedReducer(enabled=False)
    assert off.parts(x, 8, 64, True) is None and off.status()["reduction"] == "eager"


def test_a_built_library_is_loaded_at_the_first_call(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A later process finds the library built: no eager steps while a thread catches up."""
    monkeypatch.setenv("QFORENSICS_CACHE_DIR", str(tmp_path))
    first = fused.FusedReducer()
    x = torch.randn(3, 8, 16)
    assert first.parts(x, 8, 16, True) is None
    first.wait()
    assert fused.library_path().exists()
    later = fused.FusedReducer()
    assert later.parts(x, 8, 16, True) is not None
    assert later.eager_why == {} and later.fused_calls == 1


def test_no_compiler_means_eager_with_the_reason(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    monkeypatch.setenv("QFORENSICS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-cc")
    red = fused.FusedReducer()
    x = torch.randn(3, 8, 16)
    assert red.parts(x, 8, 16, True) is None
    red.wait()
    assert red.off and "no-such-cc" in red.off
    assert red.parts(x, 8, 16, True) is None
    assert red.status()["reduction"] == "eager" and "no-such-cc" in red.status()["reduction_off"]


def test_fast_parts_uses_the_fused_pass_with_the_same_numbers() -> None:
    x = torch.randn(6, 8, 200).bfloat16()
    want = _expected(x.float().numpy(), True)
    _close(torch.cat(reduce.fast_parts(x, 8, 200, True)).numpy(), want)
    fused.REDUCER.wait()
    n = fused.REDUCER.fused_calls
    _close(torch.cat(reduce.fast_parts(x, 8, 200, True)).numpy(), want)
    assert fused.REDUCER.fused_calls == n + 1


def test_packed_len_agrees_with_the_step_plans() -> None:
    from qforensics.hooks.plan import packed_size

    for g, rows, chans, keep in [(1, 1, 5, True), (3, 1, 5, False), (2, 7, 9, True),
                                 (4, 3, 11, False)]:
        assert fused.packed_len(g, rows, chans, keep) == packed_size(g, rows, chans, keep)
        x = torch.randn(g, rows, chans)
        eager = torch.cat(reduce.fast_parts(x.double(), rows, chans, keep))  # eager: float64
        assert eager.numel() == packed_size(g, rows, chans, keep)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("kernel", [True, False])
def test_nonfinite_rows_flags_exactly_the_rows_with_nan_or_inf(dtype, kernel,
                                                               monkeypatch) -> None:
    fused.REDUCER.parts(torch.zeros(1, 2, 4), 2, 4, True)
    fused.REDUCER.wait()
    if not kernel:
        monkeypatch.setattr(fused.REDUCER, "_nonfinite_fns", {})
    torch.manual_seed(0)
    t = torch.randn(7, 300).to(dtype)
    t[1, 3], t[3, 0], t[4, 299] = float("nan"), float("inf"), float("-inf")
    t[5] = torch.finfo(dtype).max  # huge but finite: a plain sum of the row would overflow
    t[6, 17] = -torch.finfo(dtype).max
    want = (~np.isfinite(t.float().numpy())).any(axis=1).astype(np.float32)
    assert want.tolist() == [0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    for x in (t, t.reshape(7, 3, 100).transpose(0, 1)[0:1], t.reshape(1, 7, 300)):
        flat = x.reshape(-1, x.shape[-1])
        exp = (~np.isfinite(flat.float().numpy())).any(axis=1).astype(np.float32)
        got = reduce.nonfinite_rows(x)
        assert got.dtype == torch.float32 and got.shape == (flat.shape[0], 1)
        np.testing.assert_array_equal(got.reshape(-1).numpy(), exp)
    if kernel and dtype != torch.float16:  # the C pass ran (fp16 has no kernel)
        assert fused.REDUCER.nonfinite_rows(t) is not None


def _logits_expected(v: np.ndarray) -> np.ndarray:
    """fast_logits' 15 figures in float64 numpy: min max mean var entropy, top-5 values, their
    indices (a stable descending sort: among equal values the lower index first)."""
    v = v.astype(np.float64)
    m = v.max()
    logp = v - m - np.log(np.exp(v - m).sum())
    order = np.argsort(-v, kind="stable")[:5]
    return np.concatenate([[v.min(), m, v.mean(), (v * v).mean() - v.mean() ** 2,
                            -(np.exp(logp) * logp).sum()], v[order], order])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_logits_kernel_matches_numpy(dtype: torch.dtype, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    red = _built(tmp_path, monkeypatch)
    gen = torch.Generator().manual_seed(1)
    v = (torch.randn(49152, generator=gen) * 4).to(dtype)
    v[[100, 200, 300]] = 30.0  # a tie at the top: argmax takes the first, like numpy's
    got = red.logits(v)
    assert got is not None
    want = _logits_expected(v.float().numpy())
    np.testing.assert_allclose(got[:5].numpy(), want[:5], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got[5:10].numpy(), want[5:10].astype(np.float32))
    np.testing.assert_array_equal(got[10:].numpy(), want[10:])
    assert got[10:13].tolist() == [100.0, 200.0, 300.0]
    # fewer than five values: the missing ranks stay NaN / -1
    short = red.logits(torch.tensor([1.0, 3.0, 2.0], dtype=dtype))
    assert short[5:8].tolist() == [3.0, 2.0, 1.0] and short[10:13].tolist() == [1.0, 2.0, 0.0]
    assert np.isnan(short[8:10].numpy()).all() and short[13:].tolist() == [-1.0, -1.0]
    # a NaN or an Inf anywhere: NaN figures, so that reduce.logits_row takes its exact pass
    for bad in (float("nan"), float("inf"), float("-inf")):
        w = v.clone()
        w[4321] = bad
        assert np.isnan(red.logits(w)[:5].numpy()).all()
    # what it does not take goes to torch's ops
    assert red.logits(v.double()) is None and red.logits(v.reshape(2, -1)) is None
    assert red.logits(torch.randn(2, 100).to(dtype)[:, 0]) is None  # strided


def test_fast_logits_rows_agree_between_the_kernel_and_torch() -> None:
    """The logits row a trace stores is the same whichever path computed it."""
    fused.REDUCER.parts(torch.zeros(1, 2, 4), 2, 4, True)
    fused.REDUCER.wait()
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(8, 49152, generator=gen) * 4).bfloat16()
    # five distinct largest values (bf16 ties would leave torch.topk's order unspecified)
    logits[-1, [4000, 17, 30000, 999, 45000]] = torch.tensor([40.0, 39.0, 38.0, 37.0, 36.0]
                                                             ).bfloat16()
    via_c = reduce.logits_row(reduce.fast_logits(logits).numpy(), logits)
    saved, fused.REDUCER._logit_fns = fused.REDUCER._logit_fns, {}
    try:
        via_torch = reduce.logits_row(reduce.fast_logits(logits).numpy(), logits)
    finally:
        fused.REDUCER._logit_fns = saved
    assert via_c is not None and len(via_c) == len(via_torch) == 18
    np.testing.assert_allclose(via_c[:5], via_torch[:5], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(via_c[5:], via_torch[5:])  # nan/inf counts, argmax, top-5
    assert via_c[7] == 4000 and via_c[8:13].tolist() == [4000, 17, 30000, 999, 45000]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fast_parts_into_a_given_vector(dtype) -> None:
    """A plan's step vector: each buffer's figures written in place (the C pass for bf16, the
    eager ops then a copy for fp16), the same numbers as a fresh vector."""
    fused.REDUCER.parts(torch.zeros(1, 2, 4), 2, 4, True)
    fused.REDUCER.wait()
    torch.manual_seed(1)
    x = torch.randn(3, 4, 50).to(dtype)
    fresh = torch.cat(reduce.fast_parts(x, 4, 50, True))
    big = torch.full((fresh.numel() + 10,), -7.0)
    view = big[5:5 + fresh.numel()]
    got = reduce.fast_parts(x, 4, 50, True, out=view)
    assert len(got) == 1 and got[0].data_ptr() == view.data_ptr()
    np.testing.assert_array_equal(view.numpy(), fresh.numpy())
    assert (big[:5] == -7).all() and (big[-5:] == -7).all()  # nothing outside it
    want = _expected(x.float().numpy(), True)
    _close(view.numpy(), want)
