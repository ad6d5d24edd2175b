"""FP8 (OCP e4m3fn, e5m2) bit patterns with numpy: decode, encode, and round like a cast.

256-entry tables built from the bit fields; no torch. Rounding is to nearest, ties to the even
code, and matches torch's float8 casts bit for bit (tests/replay/test_replay_layouts.py).
"""

from __future__ import annotations

import numpy as np

from qforensics.formats import E4M3_MAX, E5M2_MAX

FP8_MAX = {"float8_e4m3fn": E4M3_MAX, "float8_e5m2": E5M2_MAX}
_FLOAT_KINDS = "f"


def _decode_table(exp_bits: int, man_bits: int, fn: bool) -> np.ndarray:
    """float64 value of every 8-bit pattern of an FP8 format (OCP e4m3fn when fn, else IEEE-like)."""
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes >> 7, -1.0, 1.0)
    e = (codes >> man_bits) & ((1 << exp_bits) - 1)
    m = codes & ((1 << man_bits) - 1)
    bias = (1 << (exp_bits - 1)) - 1
    normal = (1.0 + m / (1 << man_bits)) * np.exp2(e - bias)
    sub = (m / (1 << man_bits)) * 2.0 ** (1 - bias)
    val = sign * np.where(e == 0, sub, normal)
    top = e == (1 << exp_bits) - 1
    if fn:  # e4m3fn: only S.1111.111 is NaN, no infinities
        val = np.where(top & (m == (1 << man_bits) - 1), np.nan, val)
    else:
        val = np.where(top & (m == 0), sign * np.inf, np.where(top, np.nan, val))
    return val


FP8_DECODE = {"float8_e4m3fn": _decode_table(4, 3, True), "float8_e5m2": _decode_table(5, 2, False)}


def decode_fp8(bits: np.ndarray, dtype: str) -> np.ndarray:
    """uint8 bit patterns -> float64 values."""
    if dtype not in FP8_DECODE:
        raise ValueError(f"unknown FP8 dtype {dtype!r}; known: {', '.join(FP8_DECODE)}")
    return FP8_DECODE[dtype][np.asarray(bits, dtype=np.uint8)]


def encode_fp8(values: np.ndarray, dtype: str = "float8_e4m3fn") -> np.ndarray:
    """Values already on the FP8 grid (from quantize_fp8) -> their uint8 bit patterns."""
    table = FP8_DECODE[dtype]
    codes = np.flatnonzero(np.isfinite(table[:128]))  # positive finite codes, ascending values
    v = np.asarray(values, dtype=np.float64)
    idx = codes[np.clip(np.searchsorted(table[codes], np.abs(v)), 0, len(codes) - 1)]
    if not np.array_equal(table[idx], np.where(np.isnan(v), np.nan, np.abs(v)), equal_nan=True):
        raise ValueError("encode_fp8 needs values on the FP8 grid (round them with quantize_fp8 first)")
    nan_code = int(np.flatnonzero(np.isnan(table[:128]))[0])
    idx = np.where(np.isnan(v), nan_code, idx)
    return (idx | np.where(np.signbit(v), 0x80, 0)).astype(np.uint8)


def quantize_fp8(x: np.ndarray, dtype: str = "float8_e4m3fn", *, saturate: bool = True) -> np.ndarray:
    """Round float64 values to the nearest FP8 value (ties to even code), as a cast does.

    Beyond the largest finite value: clamp when `saturate`, else NaN from the rounding midpoint
    above max on (e4m3fn has no infinity). NaN stays NaN.
    """
    table = FP8_DECODE[dtype]
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
