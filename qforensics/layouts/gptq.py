"""GPTQ (AutoGPTQ / GPTQModel ``QuantLinear``, and what vLLM loads as "gptq"): the packed layout.

W is [K, N]. ``qweight`` int32 [K*b/32, N] packed sequentially along K (value i of a word in
bits [i*b, (i+1)*b)); ``qzeros`` int32 [K/G, N*b/32] packed sequentially along N; ``scales``
[K/G, N]; optional ``g_idx`` [K] (the group of each input row: act-order).
W[k, n] = (q[k, n] - z[g(k), n]) * s[g(k), n].

The zero convention: GPTQ v1 checkpoints (``checkpoint_format`` "gptq", the common one) store
``zero - 1`` and every v1 kernel adds the 1 back, unmasked (a stored 2**b - 1 reads as 2**b);
v2 (``gptq_v2``, GPTQModel's ``qzero_format == 2``) stores the zero itself. Symmetric GPTQ has
every zero at 2**(b-1) (stored 2**(b-1) - 1 in v1).
"""

from __future__ import annotations

import numpy as np

from qforensics.layouts.bits import LayoutError, unpack_bits
from qforensics.layouts.groups import group_index, group_size_of

__all__ = ["BITS", "dequantize", "is_v2", "shape_problem", "sym_zero"]

BITS = (2, 4, 8)  # code widths whose values never straddle a word


def is_v2(checkpoint_format: str | None = None, qzero_format: int | None = None) -> bool:
    """Whether the checkpoint stores the zero itself (v2) rather than zero - 1 (v1)."""
    return qzero_format == 2 or str(checkpoint_format or "").lower().endswith("v2")


def sym_zero(bits: int, v2: bool) -> int:
    """The stored zero of symmetric GPTQ: the midpoint, minus one in v1."""
    return (1 << (bits - 1)) - (0 if v2 else 1)


def shape_problem(qweight: tuple[int, ...], qzeros: tuple[int, ...] | None, scales: tuple[int, ...],
                  bits: int = 4, k: int | None = None, g_idx: int | None = None) -> str | None:
    """Why these shapes are not the GPTQ layout (None: they are). `g_idx`: its length."""
    if bits not in BITS:
        return f"{bits}-bit GPTQ is not supported ({', '.join(map(str, BITS))})"
    pf = 32 // bits
    if len(qweight) != 2 or len(scales) != 2:
        return "qweight and scales must be 2-D"
    kk = qweight[0] * pf
    if k is not None and kk != k:
        return f"qweight {list(qweight)} is not [K/{pf}={k // pf}, N]"
    n = qweight[1]
    if scales[1] != n:
        return (f"qweight {list(qweight)} / scales {list(scales)} are not the GPTQ layout [K*b/32, N] "
                "/ [K/G, N] (Marlin/ExLlama repacked weights are not supported)")
    if qzeros is not None and (len(qzeros) != 2 or qzeros[1] * pf < n or qzeros[0] != scales[0]):
        return f"qzeros {list(qzeros)} does not match [groups={scales[0]}, N/{pf}] for N={n}"
    if g_idx is not None and g_idx != kk:
        return f"g_idx has {g_idx} entries for K={kk}"
    return None


def dequantize(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, bits: int = 4,
               group_size: int | None = None, g_idx: np.ndarray | None = None, *, v2: bool = False,
               out: type = np.float64) -> np.ndarray:
    """The weight W [K, N] (v1's +1 unless `v2`). Raises LayoutError for wrong shapes or group
    indices; corrupt scales give NaN/Inf entries, silently."""
    gn = None if g_idx is None else int(np.size(g_idx))
    why = shape_problem(np.shape(qweight), np.shape(qzeros), np.shape(scales), bits, g_idx=gn)
    if why:
        raise LayoutError(f"GPTQ: {why}")
    q = unpack_bits(qweight, bits, axis=0).astype(out)  # [K, N]
    k, n = q.shape
    z = unpack_bits(qzeros, bits, axis=1)[:, :n].astype(out)  # [G, N]
    if not v2:
        z = z + 1
    s = np.asarray(scales).astype(out)
    g = group_index(k, group_size_of(k, s.shape[0], group_size) if g_idx is None else 1, g_idx, s.shape[0])
    with np.errstate(invalid="ignore", over="ignore"):
        return (q - z[g]) * s[g]
