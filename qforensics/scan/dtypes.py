"""Element formats the scanner reads from raw bytes, and their decoders to float32.

Each float format knows its raw unsigned-integer view, a bit mask that flags non-finite values
without decoding (`(raw & nonfinite_mask) == nonfinite_value`), its smallest normal magnitude
(below it a nonzero value is subnormal) and a vectorized decoder. FP8 formats decode through a
256-entry lookup table from qforensics.layouts.fp8; no torch is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

import numpy as np

from qforensics.formats import BF16_MAX, E4M3_MAX, E5M2_MAX, FP16_MAX, NUMBER_FORMATS
from qforensics.layouts.fp8 import E8M0_DECODE, FP8_DECODE, SAFETENSORS_NAMES, decode_bf16

__all__ = [
    "FloatFormat",
    "FLOAT_FORMATS",
    "INT_DTYPES",
    "SAFETENSORS_BITS",
    "E4M3_TABLE",
    "E5M2_TABLE",
    "E8M0_TABLE",
]


# float32 values of every FP8 bit pattern, from qforensics.layouts.fp8 (the one decoder)
E4M3_TABLE = FP8_DECODE[SAFETENSORS_NAMES["F8_E4M3"]].astype(np.float32)
E5M2_TABLE = FP8_DECODE[SAFETENSORS_NAMES["F8_E5M2"]].astype(np.float32)
E8M0_TABLE = E8M0_DECODE.astype(np.float32)


@dataclass(frozen=True)
class FloatFormat:
    """How to test and decode one float element format stored little-endian."""

    name: str
    itemsize: int
    raw: np.dtype  # unsigned view of one element
    nonfinite_mask: int
    nonfinite_value: int
    tiny: float  # smallest positive normal; 0.0 when the format has no subnormals
    max: float
    decode: Callable[[np.ndarray], np.ndarray]  # raw -> float32 (float64 for F64)

    def with_byteorder(self, order: str) -> FloatFormat:
        if order == "<":
            return self
        raw = self.raw.newbyteorder(">")
        base = self.decode

        def decode(r: np.ndarray) -> np.ndarray:
            return base(r.astype(self.raw))

        return FloatFormat(
            self.name, self.itemsize, raw, self.nonfinite_mask, self.nonfinite_value,
            self.tiny, self.max, decode,
        )

    def nonfinite(self, raw: np.ndarray) -> np.ndarray:
        """Boolean mask of NaN/Inf elements, computed on the raw bits."""
        mask = self.raw.type(self.nonfinite_mask)
        return (raw & mask) == self.raw.type(self.nonfinite_value)


def _decode_f32(r: np.ndarray) -> np.ndarray:
    return r.view("<f4")


def _decode_f64(r: np.ndarray) -> np.ndarray:
    return r.view("<f8")


def _decode_f16(r: np.ndarray) -> np.ndarray:
    return r.view("<f2").astype(np.float32)


def _decode_bf16(r: np.ndarray) -> np.ndarray:
    return decode_bf16(r)


def _decode_e4m3(r: np.ndarray) -> np.ndarray:
    return E4M3_TABLE[r]


def _decode_e5m2(r: np.ndarray) -> np.ndarray:
    return E5M2_TABLE[r]


def _decode_e8m0(r: np.ndarray) -> np.ndarray:
    return E8M0_TABLE[r]


_F32_TINY = float(np.finfo(np.float32).tiny)
_F16_TINY = float(np.finfo(np.float16).tiny)

# Keys are safetensors dtype names; GGUF reuses F32/F16/BF16/F64. FP8 limits: qforensics.formats.
_NORMAL = {n: float(NUMBER_FORMATS[n].min_normal) for n in ("fp8-e4m3", "fp8-e5m2")}  # type: ignore[arg-type]
FLOAT_FORMATS: dict[str, FloatFormat] = {
    "F64": FloatFormat("F64", 8, np.dtype("<u8"), 0x7FF0000000000000, 0x7FF0000000000000,
                       float(np.finfo(np.float64).tiny), float(np.finfo(np.float64).max),
                       _decode_f64),
    "F32": FloatFormat("F32", 4, np.dtype("<u4"), 0x7F800000, 0x7F800000, _F32_TINY,
                       float(np.finfo(np.float32).max), _decode_f32),
    "F16": FloatFormat("F16", 2, np.dtype("<u2"), 0x7C00, 0x7C00, _F16_TINY, FP16_MAX,
                       _decode_f16),
    "BF16": FloatFormat("BF16", 2, np.dtype("<u2"), 0x7F80, 0x7F80, _F32_TINY, BF16_MAX,
                        _decode_bf16),
    "F8_E4M3": FloatFormat("F8_E4M3", 1, np.dtype("u1"), 0x7F, 0x7F, _NORMAL["fp8-e4m3"], E4M3_MAX,
                           _decode_e4m3),
    "F8_E5M2": FloatFormat("F8_E5M2", 1, np.dtype("u1"), 0x7C, 0x7C, _NORMAL["fp8-e5m2"], E5M2_MAX,
                           _decode_e5m2),
    "F8_E8M0": FloatFormat("F8_E8M0", 1, np.dtype("u1"), 0xFF, 0xFF, 0.0, NUMBER_FORMATS["fp8-e8m0"].max,
                           _decode_e8m0),
}

# Integer (and bool) element formats: read, never value-checked on their own.
INT_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype("u1"),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "I16": np.dtype("<i2"),
    "U16": np.dtype("<u2"),
    "I32": np.dtype("<i4"),
    "U32": np.dtype("<u4"),
    "I64": np.dtype("<i8"),
    "U64": np.dtype("<u8"),
}

# Every dtype the safetensors format defines, in bits per element (sub-byte ones are packed).
SAFETENSORS_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "I16": 16, "U16": 16, "I32": 32, "U32": 32, "I64": 64,
    "U64": 64, "F16": 16, "BF16": 16, "F32": 32, "F64": 64, "C64": 64,
    "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
