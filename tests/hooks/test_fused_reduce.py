"""The CPU's one-pass kernels (hooks/fused.py, fused_reduce.c): the stats op's group reduction
against statscpu's numpy kernel, the logits' figures and the non-finite row flags against numpy
and torch, and how the library is built, found and refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from qforensics.hooks import fused, reduce, statscpu, statsop

def _close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=2e-5, atol=1e-4)


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
def test_group_kernel_matches_the_python_kernel(dtype: torch.dtype, variant: str,
                                                tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """qf_group, the stats op's CPU reduction (with AVX-512 intrinsics where the CPU has them,
    and the plain C loops), writes the ring rows and token maxima of statscpu's numpy kernel;
    a tensor with a non-finite value is left to the exact pass."""
    monkeypatch.setenv("QFORENSICS_CACHE_DIR", str(tmp_path))  # a fresh build, from source
    if variant == "portable":
        _portable(monkeypatch)
    red = fused.FusedReducer()
    assert red.group() is None  # the build starts: nothing to call yet
    red.wait()
    assert red.off is None, red.off
    assert list((tmp_path / "kernels").glob("fused_reduce-*.so"))
    fn = red.group()
    assert fn is not None and red.status()["reduction"] == "fused"
    gen = torch.Generator().manual_seed(0)
    for k, (_, rows, chans) in enumerate(SHAPES):
        x = (torch.randn(rows, chans, generator=gen) * 3).to(dtype)
        if k % 3 == 2:  # a non-finite value: left to the exact pass
            x.view(-1)[7] = float("nan")
        w = statsop.entry_width(chans)
        got, want = (torch.zeros(2, w + 5), torch.zeros(2, w + 5)), None
        toks = [torch.zeros(2, 64, 1), torch.zeros(2, 64, 1)]
        counts = statscpu._group_c(fn, [x], got[0], toks[0], 1, [5], [chans], [64], [0])
        want = statscpu._each_cpu([x], statscpu._row(got[1], 1), statscpu._row(toks[1], 1), 1,
                                  [5], [chans], [64], [0])
        assert counts == want
        _close(got[0].numpy(), got[1].numpy())
        _close(toks[0].numpy(), toks[1].numpy())


def test_a_built_library_is_loaded_at_the_first_call(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A later process finds the library built: its first call has it, no thread to wait on."""
    monkeypatch.setenv("QFORENSICS_CACHE_DIR", str(tmp_path))
    first = fused.FusedReducer()
    assert first.group() is None
    first.wait()
    assert fused.library_path().exists()
    later = fused.FusedReducer()
    assert later.group() is not None and later.spans() is not None


def test_no_compiler_means_eager_with_the_reason(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    monkeypatch.setenv("QFORENSICS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-cc")
    red = fused.FusedReducer()
    assert red.group() is None
    red.wait()
    assert red.off and "no-such-cc" in red.off
    assert red.group() is None
    assert red.status()["reduction"] == "eager" and "no-such-cc" in red.status()["reduction_off"]
    assert fused.FusedReducer(enabled=False).status()["reduction"] == "eager"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("kernel", [True, False])
def test_nonfinite_rows_flags_exactly_the_rows_with_nan_or_inf(dtype, kernel,
                                                               monkeypatch) -> None:
    fused.REDUCER.ready()
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
    monkeypatch.setenv("QFORENSICS_CACHE_DIR", str(tmp_path))  # a fresh build, from source
    red = fused.FusedReducer()
    red.ready()
    red.wait()
    assert red.off is None, red.off
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
    fused.REDUCER.ready()
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


