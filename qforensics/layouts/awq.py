"""AWQ (AutoAWQ ``WQLinear_GEMM``, and what vLLM loads as "awq"): the GEMM pack.

W is [K, N]. ``qweight`` int32 [K, N/8]: word (k, c) packs columns 8c..8c+7, nibble i holding
column 8c + AWQ_ORDER[i] (AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]); ``qzeros`` int32 [K/G, N/8]
packed alike; ``scales`` [K/G, N]; optional GPTQ-style ``g_idx`` [K].
W[k, n] = (q[k, n] - z[g(k), n]) * s[g(k), n], g(k) = g_idx[k] if given else k // G.
(The GEMV pack, AWQ "version": "gemv", is another layout and is refused by the checks.)
"""

from __future__ import annotations

import numpy as np

from qforensics.layouts.bits import LayoutError, pack_awq, unpack_awq
from qforensics.layouts.groups import group_index, group_size_of

__all__ = ["dequantize", "quantize_rtn", "shape_problem"]


def shape_problem(qweight: tuple[int, ...], qzeros: tuple[int, ...] | None, scales: tuple[int, ...],
                  k: int | None = None) -> str | None:
    """Why these shapes are not the AWQ GEMM pack (None: they are). `k`: the input width, when
    known (from the layer or the call)."""
    if len(qweight) != 2 or len(scales) != 2 or (qzeros is not None and len(qzeros) != 2):
        return "qweight, qzeros and scales must be 2-D"
    if k is not None and qweight[0] != k:
        if qweight[0] * 8 == k:
            return f"qweight {list(qweight)} is [K/8, N]: that is the GPTQ layout, not AWQ's [K, N/8]"
        return f"qweight has {qweight[0]} rows, the input has K={k}"
    n = qweight[1] * 8
    if scales[1] != n or (qzeros is not None and qzeros[1] * 8 != n):
        return (f"scales {list(scales)} / qzeros {list(qzeros or ())} do not match N={n} from qweight "
                f"{list(qweight)} (the GEMM layout [K, N/8] / [K/G, N]; GEMV is not supported)")
    if qzeros is not None and qzeros[0] != scales[0]:
        return f"qzeros has {qzeros[0]} groups, scales {scales[0]}"
    return None


def dequantize(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, group_size: int | None = None,
               g_idx: np.ndarray | None = None, out: type = np.float64) -> np.ndarray:
    """The weight W [K, N]. Raises LayoutError when the shapes or a group index are wrong;
    corrupt scales give NaN/Inf entries, silently."""
    why = shape_problem(np.shape(qweight), np.shape(qzeros), np.shape(scales))
    if why:
        raise LayoutError(f"AWQ: {why}")
    q = unpack_awq(qweight).astype(out)
    z = unpack_awq(qzeros).astype(out)
    s = np.asarray(scales).astype(out)
    k = q.shape[0]
    g = group_index(k, group_size_of(k, s.shape[0], group_size), g_idx, s.shape[0])
    with np.errstate(invalid="ignore", over="ignore"):
        return (q - z[g]) * s[g]


def quantize_rtn(weight_kn: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Round-to-nearest asymmetric INT4 of a float [K, N] weight into AWQ tensors (qweight,
    qzeros int32, scales float16): min/max per group of `group_size` input rows, the range
    widened to hold 0, the float16 scale the checkpoint stores rounded up (so every weight is
    within half a step of its level) and the zero points computed with it."""
    w = np.asarray(weight_kn, dtype=np.float64)
    k, n = w.shape
    if group_size <= 0 or k % group_size or n % 8:
        raise LayoutError(f"AWQ needs K % group_size == 0 and N % 8 == 0 (K={k}, N={n}, group_size={group_size})")
    wg = w.reshape(k // group_size, group_size, n)
    lo = np.minimum(wg.min(axis=1), 0.0)
    hi = np.maximum(wg.max(axis=1), 0.0)
    scale = (hi - lo) / 15.0
    scale = np.where(scale > 0, scale, 1.0)
    s16 = scale.astype(np.float16)  # rounded up, so that 15 steps still span [lo, hi]
    s16 = np.where(s16.astype(np.float64) < scale, np.nextafter(s16, np.float16(np.inf)), s16)
    scale = s16.astype(np.float64)
    zero = np.clip(np.round(-lo / scale), 0, 15)
    q = np.clip(np.round(wg / scale[:, None, :]) + zero[:, None, :], 0, 15).reshape(k, n)
    return pack_awq(q), pack_awq(zero), scale.astype(np.float16)
