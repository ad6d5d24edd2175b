"""compressed-tensors ``pack-quantized`` (W4A16 and other int widths, what llm-compressor writes
and vLLM loads as "compressed-tensors").

``weight_packed`` int32 [N, ceil(K*b/32)]: each row's codes densely bit-packed along K (a code
may straddle two words), every value stored offset by 2**(b-1) (signed -> unsigned);
``weight_scale`` [N, K/G] (group) or [N, 1] (channel); optional ``weight_zero_point``: packed
alike along N, [ceil(N*b/32), K/G] int32, or unpacked int8 [N, K/G], or one value;
``weight_shape`` [2] = (N, K). W[k, n] = (q[n, k] - z[n, g(k)]) * s[n, g(k)], g(k) = k // G.
"""

from __future__ import annotations

import numpy as np

from qforensics.layouts.bits import LayoutError, packed_words, unpack_bits

__all__ = ["dequantize", "shape_problem", "unpack_signed"]


def unpack_signed(words: np.ndarray, bits: int, count: int, axis: int) -> np.ndarray:
    """Packed codes -> the signed values they store (code - 2**(b-1)), int16."""
    return unpack_bits(words, bits, axis=axis, count=count).astype(np.int16) - (1 << (bits - 1))


def shape_problem(packed: tuple[int, ...], scale: tuple[int, ...], shape: tuple[int, int],
                  bits: int = 4, zero_point: tuple[int, ...] | None = None) -> str | None:
    """Why these shapes are not pack-quantized of weight_shape `shape` (None: they are)."""
    if not 1 <= bits <= 8:
        return f"{bits}-bit packing is not supported (1..8)"
    n, k = shape
    if len(packed) != 2 or packed != (n, packed_words(k, bits)):
        return f"weight_packed {list(packed)} is not int32 [N={n}, ceil(K*{bits}/32)={packed_words(k, bits)}]"
    if len(scale) != 2 or scale[0] != n or not 1 <= scale[1] <= k:
        return f"weight_scale {list(scale)} does not fit weight_shape {[n, k]} (per-channel or per-group)"
    if zero_point is not None and len(zero_point) > 0 and int(np.prod(zero_point)) > 1:
        groups = scale[1]
        if tuple(zero_point) not in ((n, groups), (packed_words(n, bits), groups)):
            return f"weight_zero_point {list(zero_point)} is neither [N={n}, {groups}] nor packed along N"
    return None


def _groups(k: int, ngroups: int, group_size: int | None) -> np.ndarray:
    if ngroups == 1:
        return np.zeros(k, np.int64)
    g = group_size if group_size and group_size > 0 else None
    if g is None:
        if k % ngroups:
            raise LayoutError(f"K={k} does not divide into {ngroups} groups; state the group size")
        g = k // ngroups
    idx = np.arange(k, dtype=np.int64) // g
    if idx[-1] >= ngroups:
        raise LayoutError(f"group size {g} needs {idx[-1] + 1} scale columns for K={k}, weight_scale has {ngroups}")
    return idx


def dequantize(weight_packed: np.ndarray, weight_scale: np.ndarray, weight_shape: tuple[int, int] | None = None,
               bits: int = 4, weight_zero_point: np.ndarray | None = None, group_size: int | None = None,
               out: type = np.float64) -> np.ndarray:
    """The weight W [K, N]. Raises LayoutError for wrong shapes; corrupt scales give NaN/Inf."""
    wp = np.asarray(weight_packed)
    if weight_shape is None:
        if (wp.shape[1] * 32) % bits:
            raise LayoutError("weight_shape is needed: the packed words do not hold a whole number of codes")
        weight_shape = (wp.shape[0], wp.shape[1] * 32 // bits)
    n, k = (int(v) for v in weight_shape)
    s = np.asarray(weight_scale).astype(out)
    s = s.reshape(n, -1) if s.size == n else s
    zp = None if weight_zero_point is None else np.asarray(weight_zero_point)
    why = shape_problem(wp.shape, s.shape, (n, k), bits, None if zp is None else zp.shape)
    if why:
        raise LayoutError(f"compressed-tensors: {why}")
    q = unpack_signed(wp, bits, k, axis=1).astype(out)  # [N, K]
    g = _groups(k, s.shape[1], group_size)
    if zp is not None and zp.size > 1:
        z = (zp if zp.shape[0] == n else unpack_signed(zp, bits, n, axis=0)).astype(out)
        q = q - z.reshape(n, -1)[:, g]
    elif zp is not None and zp.size == 1:
        q = q - float(zp.reshape(-1)[0])
    with np.errstate(invalid="ignore", over="ignore"):
        return (q * s[:, g]).T
