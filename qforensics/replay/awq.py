"""AWQ INT4 packed layout: pack, unpack and dequantize with numpy (the replay's ground truth).

Layout (docs/replay.md, ../shared/reference/awq-layout.md): W is [K, N]; qweight int32 [K, N/8]
where word (k, c) packs columns 8c..8c+7, nibble i holding column 8c + ORDER[i]; qzeros int32
[n_groups, N/8] packed the same way; scales float16 [n_groups, N]; optional GPTQ g_idx int32 [K].
W[k, n] = (q[k, n] - z[g(k), n]) * s[g(k), n], g(k) = g_idx[k] if given else k // group_size.
"""

from __future__ import annotations

import numpy as np

from qforensics.errors import ReplayError

ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7], dtype=np.int64)
REVERSE = np.array([0, 4, 1, 5, 2, 6, 3, 7], dtype=np.int64)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """[R, C] int32 AWQ-packed words -> [R, 8C] uint8 values in column order."""
    words = np.asarray(packed).astype(np.int64) & 0xFFFFFFFF
    shifts = 4 * REVERSE  # column 8c + j lives in nibble REVERSE[j]
    vals = (words[:, :, None] >> shifts[None, None, :]) & 0xF
    return vals.reshape(words.shape[0], -1).astype(np.uint8)


def pack_int4(values: np.ndarray) -> np.ndarray:
    """[R, N] integer values in 0..15 (N % 8 == 0) -> [R, N/8] int32 AWQ-packed words."""
    v = np.asarray(values).astype(np.int64)
    if v.ndim != 2 or v.shape[1] % 8:
        raise ReplayError(f"pack_int4 needs a [R, N] array with N % 8 == 0, got shape {v.shape}")
    if v.size and (v.min() < 0 or v.max() > 15):
        raise ReplayError("pack_int4 values must lie in 0..15")
    v = v.reshape(v.shape[0], -1, 8)
    words = np.zeros(v.shape[:2], dtype=np.int64)
    for j in range(8):
        words |= v[:, :, j] << (4 * REVERSE[j])
    return words.astype(np.uint32).view(np.int32)


def group_index(k: int, group_size: int, g_idx: np.ndarray | None) -> np.ndarray:
    """Group of every input row 0..k-1, as the kernel computes it (may be out of range)."""
    if g_idx is not None:
        return np.asarray(g_idx, dtype=np.int64)
    return np.arange(k, dtype=np.int64) // group_size


def dequantize(
    qweight: np.ndarray,
    qzeros: np.ndarray,
    scales: np.ndarray,
    group_size: int,
    g_idx: np.ndarray | None = None,
) -> np.ndarray:
    """Dequantize to float64 [K, N]. Raises ReplayError when a group index is out of range."""
    q = unpack_int4(qweight).astype(np.float64)
    z = unpack_int4(qzeros).astype(np.float64)
    s = np.asarray(scales).astype(np.float64)
    k = q.shape[0]
    g = group_index(k, group_size, g_idx)
    bad = (g < 0) | (g >= s.shape[0])
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise ReplayError(
            f"group index {int(g[first])} of input row {first} is outside 0..{s.shape[0] - 1} "
            f"(K={k}, group_size={group_size}, {'g_idx' if g_idx is not None else 'k // group_size'});"
            " the CPU reference cannot be computed for out-of-range groups"
        )
    return (q - z[g]) * s[g]


def quantize_rtn(weight_kn: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Round-to-nearest asymmetric INT4 of a float [K, N] weight into AWQ tensors.

    Used to feed the project kernel when a snapshot holds a dense weight: the replay then checks
    the launch geometry; numerics are compared against the dequantized packed weight.
    """
    w = np.asarray(weight_kn, dtype=np.float64)
    k, n = w.shape
    if group_size <= 0 or k % group_size or n % 8:
        raise ReplayError(
            f"quantize_rtn needs K % group_size == 0 and N % 8 == 0 (K={k}, N={n}, group_size={group_size})"
        )
    wg = w.reshape(k // group_size, group_size, n)
    lo = np.minimum(wg.min(axis=1), 0.0)
    hi = np.maximum(wg.max(axis=1), 0.0)
    scale = (hi - lo) / 15.0
    scale = np.where(scale > 0, scale, 1.0)
    scale16 = scale.astype(np.float16)
    scale = scale16.astype(np.float64)
    scale = np.where(scale > 0, scale, 1.0)
    scale16 = scale.astype(np.float16)
    zero = np.clip(np.round(-lo / scale), 0, 15)
    q = np.clip(np.round(wg / scale[:, None, :]) + zero[:, None, :], 0, 15).reshape(k, n)
    return pack_int4(q), pack_int4(zero), scale16
