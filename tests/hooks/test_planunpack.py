"""hooks/planunpack.py: a plan's vectorized unpack gives bit for bit what UniqueStats.unpack
gives, on random reduced vectors with NaN and Inf, for every kind of buffer (one token or
many, channel ranges kept or not, kept for some tensors only), and a real capture's records are
the same with and without it."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import qforensics
from qforensics.hooks import fused, planunpack, reduce
from qforensics.hooks.assemble import UniqueStats
from qforensics.hooks.plan import packed_size

from capture_models import Tiny, ids


def _layout(rng: np.random.Generator):
    """Plan rows over 14 unique tensors, and a host vector with room after them."""
    specs = [  # (unique ids, rows, chans, keep)
        ([3], 5, 7, True),  # a single reduced in its hook
        ([0, 1, 2], 1, 6, True),
        ([4, 5], 1, 4, False),
        ([6, 7, 8], 4, 5, True),
        ([9, 10], 3, 6, False),
        ([11, 12, 13], 2, 3, True),
    ]
    cpu = torch.device("cpu")
    plan = [(np.array(i, np.int64), r, c, k, cpu, packed_size(len(i), r, c, k))
            for i, r, c, k in specs]
    size = sum(row[-1] for row in plan)
    h = rng.standard_normal(size + 15).astype(np.float32) * 10
    h[rng.choice(size, 6, replace=False)] = [np.nan, np.inf, -np.inf, np.nan, np.inf, 0.0]
    return plan, h


def _fill(plan, h, need, vectorized: bool) -> UniqueStats:
    st = UniqueStats(14, need)
    if vectorized:
        up = planunpack.PlanUnpack(plan, need)
        up.apply(st, h)
        assert up.size == sum(row[-1] for row in plan)
    else:
        st.unpack(plan, {torch.device("cpu"): h}, {torch.device("cpu"): 0})
    return st


def test_vectorized_unpack_equals_the_generic_one():
    rng = np.random.default_rng(0)
    for trial in range(20):
        plan, h = _layout(rng)
        need = rng.random(14) < (1.0 if trial % 2 else 0.6)
        a, b = _fill(plan, h, need, True), _fill(plan, h, need, False)
        for name in ("sc", "rows", "computed", "tok_off", "tok_cnt", "chan_off"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name),
                                          err_msg=f"{name}, trial {trial}")
        for fn in ("cmin", "cmax", "tok"):
            np.testing.assert_array_equal(getattr(a, fn)(), getattr(b, fn)(), err_msg=fn)
        lo_a, hi_a = a.channel_blocks()
        lo_b, hi_b = b.channel_blocks()
        assert (lo_a is hi_a) == (lo_b is hi_b)


def test_single_token_buffers_share_one_channel_block():
    cpu = torch.device("cpu")
    plan = [(np.array([0, 1], np.int64), 1, 4, True, cpu, packed_size(2, 1, 4, True))]
    h = np.arange(16, dtype=np.float32)
    st = UniqueStats(2, np.ones(2, bool))
    planunpack.PlanUnpack(plan, np.ones(2, bool)).apply(st, h)
    lo, hi = st.channel_blocks()
    assert lo is hi
    np.testing.assert_array_equal(lo, h[8:16])  # after sums, squares, mins, maxes
    np.testing.assert_array_equal(st.sc[:, 0], [4.0, 5.0])


def _capture(tmp_path, name: str) -> list:
    m = Tiny()
    path = tmp_path / f"{name}.h5"
    with torch.no_grad(), qforensics.capture(m, path, compiled=False):
        x = ids(4)
        for _ in range(6):  # decode-like: one new token per step after the first
            logits = m(x)
            x = logits[:, -1:].argmax(-1)
    with qforensics.open_trace(path) as t:
        out = []
        for s in range(t.n_steps):
            recs = t.records(s)
            ranges = [t.channel_ranges(r) for _, r in recs.iterrows()]
            out.append((recs, ranges))
        return out


def test_records_are_the_same_on_every_path(tmp_path, monkeypatch):
    """The split layout (default on CPU), the packed layout with the vectorized unpack, and
    the generic unpack: the same records and channel ranges."""
    fused.REDUCER.parts(torch.zeros(1, 2, 4), 2, 4, True)
    fused.REDUCER.wait()
    used = {"split": 0, "packed": 0}
    real_split, real_unpacker = planunpack.SplitLayout.apply, planunpack.unpacker

    def split_apply(self, *a):
        used["split"] += 1
        return real_split(self, *a)

    def unpacker(*a):
        up = real_unpacker(*a)
        used["packed"] += up is not None
        return up

    monkeypatch.setattr(planunpack.SplitLayout, "apply", split_apply)
    monkeypatch.setattr(planunpack, "unpacker", unpacker)
    split = _capture(tmp_path, "split")
    assert used["split"] and not used["packed"]  # no hook-reduced tensors here
    monkeypatch.setattr(planunpack, "split_layout", lambda pl: None)
    packed = _capture(tmp_path, "packed")
    assert used["packed"]
    monkeypatch.setattr(planunpack, "unpacker", lambda *a: None)
    generic = _capture(tmp_path, "generic")
    assert len(split) == len(packed) == len(generic) == 6
    kept = 0
    for other in (split, packed):
        for (a, ra), (b, rb) in zip(other, generic):
            pd.testing.assert_frame_equal(a.reset_index(drop=True), b.reset_index(drop=True))
            for x, y in zip(ra, rb):
                assert (x is None) == (y is None)
                if x is not None:
                    kept += 1
                    np.testing.assert_array_equal(x[0], y[0])
                    np.testing.assert_array_equal(x[1], y[1])
    assert kept


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.float64])
def test_split_layout_equals_the_packed_one(dtype):
    """The kernel's split layout and SplitLayout.apply against fast_parts' packed vectors and
    UniqueStats.unpack, on tensors with NaN and Inf, every kind of buffer; fp16 and an int64
    buffer beside the others (no kernel of their own: the split layout converts them to
    float32 for the kernel, so the packed side is taken on their float32 conversion); float64
    through the torch ops, in float64."""
    fused.REDUCER.parts(torch.zeros(1, 2, 4), 2, 4, True)
    fused.REDUCER.wait()
    cpu = torch.device("cpu")
    rng = torch.Generator().manual_seed(3)
    specs = [([0, 1, 2], 1, 6, True), ([3, 4], 1, 4, False), ([5, 6, 7], 4, 5, True),
             ([8, 9], 3, 6, False), ([10, 11, 12], 2, 3, True)]
    for trial in range(6):
        red = []
        for idx, r, c, k in specs:
            x = (torch.randn(len(idx), r, c, generator=rng) * 10).to(dtype)
            if trial % 2:
                flat = x.view(-1)
                flat[torch.randint(0, flat.numel(), (2,), generator=rng)] = torch.tensor(
                    [float("nan"), float("inf")], dtype=dtype)
            red.append((x, (np.array(idx, np.int64), r, c, k, cpu, packed_size(len(idx), r, c,
                                                                               k))))
        ints = torch.randint(-50, 50, (2, 3, 4), generator=rng)  # no kernel for integers
        red.append((ints, (np.array([13, 14], np.int64), 3, 4, True, cpu,
                           packed_size(2, 3, 4, True))))
        need = np.array([(j + trial) % 3 != 0 for j in range(15)]) if trial > 2 else np.ones(
            15, bool)
        lay = planunpack.SplitLayout(red)
        buf = lay.reduce(red)
        assert buf is not None
        a = UniqueStats(15, need)
        lay.apply(a, buf)
        host = torch.cat([torch.cat(reduce.fast_parts(
            x if x.dtype in (torch.bfloat16, torch.float32, torch.float64) else x.float(), r[1],
            r[2], r[3]))
            for x, r in red])
        b = UniqueStats(15, need)
        b.unpack([r for _, r in red], {cpu: host.numpy()}, {cpu: 0})
        for name in ("sc", "rows", "computed", "tok_off", "tok_cnt", "chan_off"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name),
                                          err_msg=f"{name}, trial {trial}")
        for fn in ("cmin", "cmax", "tok"):
            np.testing.assert_array_equal(getattr(a, fn)(), getattr(b, fn)(),
                                          err_msg=f"{fn}, trial {trial}")


def test_reduceat_spans_may_end_at_the_vector_end():
    h = np.array([5.0, 1.0, 7.0, -2.0, 3.0], np.float32)
    pairs = np.array([0, 2, 3, 5], np.int64)  # spans [0, 2) and [3, 5): the last ends at n
    idx = planunpack._ends(pairs, len(h))
    np.testing.assert_array_equal(np.minimum.reduceat(h, idx)[::2], [1.0, -2.0])
    np.testing.assert_array_equal(np.maximum.reduceat(h, idx)[::2], [5.0, 3.0])
