"""Integer codes packed into int32 words, with numpy: the sequential bit stream and AWQ's
interleaved nibble order.

- Sequential (GPTQ, compressed-tensors, vLLM's repacks): value i of a row occupies bits
  ``[i*b, (i+1)*b)`` of the row's little-endian bit stream, word after word; when ``b`` does not
  divide 32 a value may straddle two words (compressed-tensors packs densely, with no padding).
- AWQ (AutoAWQ's GEMM layout): 8 nibbles per word, nibble ``i`` holding column ``8c +
  AWQ_ORDER[i]`` of the word's 8 columns.
"""

from __future__ import annotations

import numpy as np

__all__ = ["AWQ_ORDER", "AWQ_REVERSE", "LayoutError", "pack_awq", "pack_bits", "packed_words",
           "unpack_awq", "unpack_bits"]

AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7], dtype=np.int64)  # column of nibble i
AWQ_REVERSE = np.argsort(AWQ_ORDER)  # nibble of column j: [0, 4, 1, 5, 2, 6, 3, 7]


class LayoutError(ValueError):
    """Tensors contradict the layout they claim (shape, dtype, packing, group indices)."""


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise LayoutError(f"packed codes must be 1..8 bits wide, got {bits!r}")


def packed_words(count: int, bits: int) -> int:
    """How many int32 words hold `count` codes of `bits` bits (densely)."""
    return -(-count * bits // 32)


def unpack_bits(words: np.ndarray, bits: int, axis: int = -1, count: int | None = None) -> np.ndarray:
    """int32 words -> uint8 codes, unpacked along `axis` (sequential bit stream).

    `count`: how many codes the axis holds (default: all whole codes in the words).
    """
    _check_bits(bits)
    w = np.moveaxis(np.asarray(words), axis, -1)
    if w.dtype.kind not in "iu" or w.dtype.itemsize != 4:
        raise LayoutError(f"packed words must be 32-bit integers, got {w.dtype}")
    total = w.shape[-1] * 32 // bits
    count = total if count is None else int(count)
    if count > total:
        raise LayoutError(f"{w.shape[-1]} words hold {total} codes of {bits} bits, not {count}")
    stream = np.unpackbits(np.ascontiguousarray(w.astype("<u4")).view(np.uint8), axis=-1,
                           bitorder="little")[..., : count * bits]
    codes = stream.reshape(*w.shape[:-1], count, bits)
    if bits < 8:
        codes = np.concatenate([codes, np.zeros((*codes.shape[:-1], 8 - bits), np.uint8)], -1)
    out = np.packbits(codes, axis=-1, bitorder="little")[..., 0]
    return np.moveaxis(out, -1, axis)


def pack_bits(values: np.ndarray, bits: int, axis: int = -1) -> np.ndarray:
    """Inverse of `unpack_bits`: codes 0..2**bits-1 packed densely into int32 words along axis."""
    _check_bits(bits)
    v = np.moveaxis(np.asarray(values), axis, -1)
    if v.size and (v.min() < 0 or v.max() >= 1 << bits):
        raise LayoutError(f"codes to pack in {bits} bits must lie in 0..{(1 << bits) - 1}")
    codes = np.unpackbits(v.astype(np.uint8)[..., None], axis=-1, bitorder="little")[..., :bits]
    stream = codes.reshape(*v.shape[:-1], v.shape[-1] * bits)
    nwords = packed_words(v.shape[-1], bits)
    pad = nwords * 32 - stream.shape[-1]
    stream = np.concatenate([stream, np.zeros((*stream.shape[:-1], pad), np.uint8)], -1)
    words = np.packbits(stream, axis=-1, bitorder="little").view("<u4").astype(np.uint32)
    return np.moveaxis(words.view(np.int32), -1, axis)


def unpack_awq(words: np.ndarray) -> np.ndarray:
    """[R, C] int32 AWQ words -> [R, 8C] uint8 codes in column order."""
    w = np.asarray(words)
    if w.ndim != 2:
        raise LayoutError(f"AWQ words must be 2-D [R, N/8], got shape {w.shape}")
    nib = unpack_bits(w, 4, axis=1).reshape(w.shape[0], w.shape[1], 8)
    return nib[:, :, AWQ_REVERSE].reshape(w.shape[0], -1)


def pack_awq(values: np.ndarray) -> np.ndarray:
    """[R, N] codes 0..15 (N % 8 == 0) -> [R, N/8] int32 AWQ words."""
    v = np.asarray(values)
    if v.ndim != 2 or v.shape[1] % 8:
        raise LayoutError(f"AWQ packs a [R, N] array with N % 8 == 0, got shape {v.shape}")
    nib = v.reshape(v.shape[0], -1, 8)[:, :, AWQ_ORDER].reshape(v.shape[0], -1)
    return pack_bits(nib, 4, axis=1)
