"""Which quantization group each input row reads its scale and zero point from."""

from __future__ import annotations

import numpy as np

from qforensics.layouts.bits import LayoutError

__all__ = ["group_index", "group_size_of"]


def group_size_of(k: int, ngroups: int, group_size: int | None) -> int:
    """The group size: the stated one (-1 or None with one group: all of K), else K / groups."""
    if group_size is not None and group_size > 0:
        return int(group_size)
    if group_size == -1 or ngroups == 1:
        return k
    if ngroups <= 0 or k % ngroups:
        raise LayoutError(f"K={k} input rows do not divide into {ngroups} groups; state the group size")
    return k // ngroups


def group_index(k: int, group_size: int, g_idx: np.ndarray | None, ngroups: int) -> np.ndarray:
    """Group of every input row 0..k-1 (g_idx: act-order), checked against `ngroups`."""
    if g_idx is not None:
        g = np.asarray(g_idx, dtype=np.int64).reshape(-1)
        if g.size != k:
            raise LayoutError(f"g_idx has {g.size} entries, K={k}")
        how = "g_idx"
    else:
        g = np.arange(k, dtype=np.int64) // group_size
        how = "k // group_size"
    bad = (g < 0) | (g >= ngroups)
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise LayoutError(f"group index {int(g[first])} of input row {first} is outside 0..{ngroups - 1} "
                          f"(K={k}, group_size={group_size}, {how}); out-of-range groups have no scale")
    return g
