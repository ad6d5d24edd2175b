"""Device reductions in bounded chunks give the numbers numpy computes on the whole tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qforensics.hooks import reduce


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(reduce, "REDUCE_CHUNK_ELEMS", 64)  # 4 rows of 16 channels per chunk


def test_fast_one_in_chunks(small_chunks):
    torch.manual_seed(0)
    x = torch.randn(37, 16, dtype=torch.float16)
    got = reduce.fast_one(x, 37, 16, True).numpy().astype(np.float64)
    a = x.double().numpy()
    want = np.concatenate([[a.sum(), (a * a).sum()], a.min(0), a.max(0), np.abs(a).max(1)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_exact_group_in_chunks_counts_and_skips_nonfinite(small_chunks):
    torch.manual_seed(1)
    xs = [torch.randn(21, 16) for _ in range(2)]
    xs[0][3, 5] = float("nan")
    xs[0][20, 0] = float("inf")
    xs[1][:, 7] = float("nan")  # a channel with no finite value
    got = reduce.exact_group(xs, 21, 16, True).numpy()
    g = 2
    head = got[:7 * g].reshape(7, g)
    for i, x in enumerate(xs):
        a = x.double().numpy()
        fin = np.isfinite(a)
        f = a[fin]
        np.testing.assert_allclose(head[:5, i], [f.min(), f.max(), f.mean(), f.std(),
                                                 np.abs(f).max()], rtol=1e-5)
        assert head[5, i] == np.isnan(a).sum() and head[6, i] == np.isinf(a).sum()
    cmin = got[7 * g:7 * g + g * 16].reshape(g, 16)
    a1 = xs[1].double().numpy()
    assert np.isnan(cmin[1, 7])
    np.testing.assert_allclose(np.delete(cmin[1], 7), np.delete(a1.min(0), 7), rtol=1e-6)
    tok = got[7 * g + 2 * g * 16:].reshape(g, 21)
    # the per-token maxima tell the bad rows: NaN for row 3, Inf for row 20, finite elsewhere
    a0 = xs[0].double().numpy()
    assert np.isnan(tok[0, 3]) and np.isposinf(tok[0, 20])
    np.testing.assert_allclose(tok[0], np.abs(a0).max(1), rtol=1e-6)
    assert np.isnan(tok[1]).all()  # every row of xs[1] holds its NaN channel
