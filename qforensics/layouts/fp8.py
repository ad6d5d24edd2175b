"""FP8 and bfloat16 with numpy: decode bit patterns, round like a cast, and dequantize an FP8
weight with its scales.

Bit patterns are decoded by ml_dtypes (OCP ``float8_e4m3fn``, ``float8_e5m2``, the MX scale
format ``float8_e8m0fnu``, and ``bfloat16``). Rounding to FP8 is to the nearest value, ties to
the even code, and matches torch's float8 casts bit for bit (tests/replay). Format limits come
from qforensics.formats, the one place for them.

An FP8 weight ``[N, K]`` is dequantized with ``weight_scale`` (some checkpoints call it
``weight_scale_inv``; it multiplies all the same): per tensor (one value), per output channel
(``[N]`` or ``[N, 1]``), or per block (``[ceil(N/bn), ceil(K/bk)]`` for ``weight_block_size``
``[bn, bk]``).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import numpy as np

from qforensics.formats import FP8_FORMAT_NAMES, NUMBER_FORMATS, canonical_format
from qforensics.layouts.bits import LayoutError

__all__ = ["E8M0_DECODE", "FP8_DECODE", "FP8_DTYPES", "FP8_MAX", "FP8_NAMES", "SAFETENSORS_NAMES", "block_of", "decode_bf16", "decode_fp8", "dtype_name",
           "dequantize_fp8", "encode_fp8", "expand_scale", "quantize_fp8", "scale_kind"]

# the FP8 element formats by their dtype names (torch's and ml_dtypes'), read from the one table
# in qforensics.formats; any other spelling of them ("fp8-e4m3", "e4m3fn") is read through
# its alias map
FP8_NAMES = tuple(NUMBER_FORMATS[n].dtype for n in FP8_FORMAT_NAMES)  # float8_e4m3fn, float8_e5m2
FP8_MAX = {NUMBER_FORMATS[n].dtype: NUMBER_FORMATS[n].max for n in FP8_FORMAT_NAMES}
_ALL_CODES = np.arange(256, dtype=np.uint8)


@lru_cache(maxsize=None)
def _tables() -> dict[str, Any]:
    """ml_dtypes and the decode tables, built at first use: importing ml_dtypes costs about a
    second of CPU (numpy's ufunc registration), which a report or an analyze that never
    decodes an FP8 byte should not pay."""
    import ml_dtypes

    dtypes = {n: getattr(ml_dtypes, n) for n in FP8_NAMES}
    return {"FP8_DTYPES": dtypes, "bfloat16": ml_dtypes.bfloat16,
            "FP8_DECODE": {n: _ALL_CODES.view(dt).astype(np.float64) for n, dt in dtypes.items()},
            "E8M0_DECODE": _ALL_CODES.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)}


def __getattr__(name: str) -> Any:  # FP8_DTYPES, FP8_DECODE, E8M0_DECODE: built lazily
    if name in ("FP8_DTYPES", "FP8_DECODE", "E8M0_DECODE"):
        return _tables()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# the same formats (and the MX scale format) under the names safetensors headers use
SAFETENSORS_NAMES = {NUMBER_FORMATS[n].safetensors: NUMBER_FORMATS[n].dtype
                     for n in (*FP8_FORMAT_NAMES, "fp8-e8m0")}


def dtype_name(fmt: str) -> str:
    """The dtype name ("float8_e4m3fn") of an FP8 element format given by any of its names."""
    canon = canonical_format(fmt)
    if canon not in FP8_FORMAT_NAMES:
        raise LayoutError(f"unknown FP8 dtype {fmt!r}; known: {', '.join(FP8_NAMES)}")
    return NUMBER_FORMATS[canon].dtype


def _table(dtype: str) -> np.ndarray:
    return _tables()["FP8_DECODE"][dtype_name(dtype)]


def decode_fp8(bits: np.ndarray, dtype: str = "float8_e4m3fn") -> np.ndarray:
    """uint8 bit patterns -> float64 values."""
    return _table(dtype)[np.asarray(bits, dtype=np.uint8)]


def decode_bf16(bits: np.ndarray) -> np.ndarray:
    """uint16 bit patterns of bfloat16 -> float32 values."""
    return np.asarray(bits, dtype=np.uint16).view(_tables()["bfloat16"]).astype(np.float32)


def encode_fp8(values: np.ndarray, dtype: str = "float8_e4m3fn") -> np.ndarray:
    """Values already on the FP8 grid (from quantize_fp8) -> their uint8 bit patterns."""
    table = _table(dtype)
    codes = np.flatnonzero(np.isfinite(table[:128]))  # positive finite codes, ascending values
    v = np.asarray(values, dtype=np.float64)
    idx = codes[np.clip(np.searchsorted(table[codes], np.abs(v)), 0, len(codes) - 1)]
    if not np.array_equal(table[idx], np.where(np.isnan(v), np.nan, np.abs(v)), equal_nan=True):
        raise LayoutError("encode_fp8 needs values on the FP8 grid (round them with quantize_fp8 first)")
    nan_code = int(np.flatnonzero(np.isnan(table[:128]))[0])
    idx = np.where(np.isnan(v), nan_code, idx)
    return (idx | np.where(np.signbit(v), 0x80, 0)).astype(np.uint8)


def quantize_fp8(x: np.ndarray, dtype: str = "float8_e4m3fn", *, saturate: bool = True) -> np.ndarray:
    """Round float64 values to the nearest FP8 value (ties to even code), as a cast does.

    Beyond the largest finite value: clamp when `saturate`, else NaN from the rounding midpoint
    above max on (e4m3fn has no infinity). NaN stays NaN.
    """
    table = _table(dtype)
    pos = np.unique(table[np.isfinite(table) & (table >= 0)])  # ascending grid 0 .. max
    a = np.abs(np.asarray(x, dtype=np.float64))
    idx = np.clip(np.searchsorted(pos, a), 1, len(pos) - 1)
    lo, hi = pos[idx - 1], pos[idx]
    # ties to even: the grid index parity is the code's last mantissa bit
    pick_hi = (hi - a < a - lo) | ((hi - a == a - lo) & (idx % 2 == 0))
    q = np.where(pick_hi, hi, lo)
    top = pos[-1]
    over = a > top
    if saturate:
        q = np.where(over, top, q)
    else:
        step = top - pos[-2]
        q = np.where(over & (a < top + step / 2), top, np.where(over, np.nan, q))
    q = np.where(np.isnan(a), np.nan, q)
    return np.copysign(q, x)


def scale_kind(scale_shape: tuple[int, ...], n: int, k: int,
               block: tuple[int, int] | None = None) -> str | None:
    """"tensor", "channel" or "block" for a weight_scale of this shape on an [N, K] weight; None
    when it is none of them. A block grid must match `block` when given."""
    size = math.prod(scale_shape)
    if size == 1:
        return "tensor"
    if tuple(scale_shape) in ((n,), (n, 1)):
        return "channel"
    if len(scale_shape) != 2 or not all(scale_shape):
        return None
    if block is not None:
        grid = (math.ceil(n / block[0]), math.ceil(k / block[1]))
        return "block" if tuple(scale_shape) == grid else None
    bn, bk = block_of(scale_shape, n, k)
    return "block" if (math.ceil(n / bn), math.ceil(k / bk)) == tuple(scale_shape) else None


def block_of(scale_shape: tuple[int, ...], n: int, k: int) -> tuple[int, int]:
    """The [bn, bk] block a 2-D scale grid implies for an [N, K] weight (when none is stated)."""
    return math.ceil(n / scale_shape[0]), math.ceil(k / scale_shape[1])


def expand_scale(scale: np.ndarray, n: int, k: int, block: tuple[int, int] | None = None,
                 dtype: type = np.float64) -> np.ndarray:
    """weight_scale broadcast to the [N, K] weight (per tensor, per channel, or per block)."""
    s = np.asarray(scale).astype(dtype)
    kind = scale_kind(s.shape, n, k, block)
    if kind is None:
        raise LayoutError(f"weight_scale {s.shape} is neither per-tensor, per-channel [N={n}] nor "
                          f"a block grid of weight [{n}, {k}]" + (f" for block {list(block)}" if block else ""))
    if kind == "tensor":
        return np.broadcast_to(s.reshape(1, 1), (n, k))
    if kind == "channel":
        return np.broadcast_to(s.reshape(n, 1), (n, k))
    bn, bk = block or block_of(s.shape, n, k)
    return np.repeat(np.repeat(s, bn, axis=0)[:n], bk, axis=1)[:, :k]


def dequantize_fp8(bits: np.ndarray, scale: np.ndarray, dtype: str = "float8_e4m3fn",
                   block: tuple[int, int] | None = None, out: type = np.float64) -> np.ndarray:
    """FP8 weight bits [N, K] and weight_scale -> the weight W [K, N] (y = x @ W)."""
    b = np.asarray(bits)
    if b.dtype != np.uint8 or b.ndim != 2:
        raise LayoutError(f"an FP8 weight is held as uint8 bit patterns [N, K], got {b.dtype} {b.shape}")
    n, k = b.shape
    w = _table(dtype).astype(out)[b]
    with np.errstate(invalid="ignore", over="ignore"):
        return (w * expand_scale(scale, n, k, block, out)).T
