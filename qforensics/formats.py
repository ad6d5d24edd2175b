"""One source of truth, torch-free: the kinds of hooked module and the limits of number formats.

Module kinds are what capture writes into /modules/kind and what the analysis, what-if and guard
select on; the trace reader refuses any other value. Format limits are the largest finite value
of each floating-point format (saturation or overflow above it), the smallest subnormal of the
FP8 formats, and the integer ranges of the INT grids. Every module that needs one of these
imports it from here instead of writing the number down again.
"""

from __future__ import annotations

# -- module kinds (/modules/kind) ----------------------------------------------------------------
KIND_LINEAR = "linear"  # a dense Linear (nn.Linear, Conv1D, ...)
KIND_QUANTIZED_LINEAR = "quantized_linear"  # a Linear whose weights a quantization library packs
KIND_BLOCK = "block"  # a decoder block
KIND_ROOT = "root"  # the model itself (its output holds the logits)
KIND_OTHER = "other"  # any other module a user asked for by name or filter
MODULE_KINDS: frozenset[str] = frozenset({KIND_LINEAR, KIND_QUANTIZED_LINEAR, KIND_BLOCK,
                                          KIND_ROOT, KIND_OTHER})
GEMM_KINDS: tuple[str, ...] = (KIND_LINEAR, KIND_QUANTIZED_LINEAR)  # modules that run a GEMM

# -- floating-point formats ----------------------------------------------------------------------
E4M3_MAX = 448.0  # float8_e4m3fn: S.1111.110 (no infinities; S.1111.111 is NaN)
E5M2_MAX = 57344.0  # float8_e5m2: S.11110.11
FP16_MAX = 65504.0  # float16
BF16_MAX = 3.3895313892515355e38  # bfloat16: (2 - 2**-7) * 2**127
E4M3_MIN_SUBNORMAL = 2.0 ** -9
E5M2_MIN_SUBNORMAL = 2.0 ** -16

# Largest finite value by the analyzer's format names (overflow limits).
FORMAT_LIMITS: dict[str, float] = {
    "fp8-e4m3": E4M3_MAX,
    "fp8-e5m2": E5M2_MAX,
    "fp16": FP16_MAX,
}
# Smallest positive (subnormal) value of each FP8 format: below half of it, a value rounds to 0.
FP8_MIN_SUBNORMAL: dict[str, float] = {
    "fp8-e4m3": E4M3_MIN_SUBNORMAL,
    "fp8-e5m2": E5M2_MIN_SUBNORMAL,
}


# -- integer grids -------------------------------------------------------------------------------
def int_range(bits: int, signed: bool = True) -> tuple[int, int]:
    """(lowest, highest) integer of a `bits`-bit grid: (-8, 7) for signed INT4, (0, 255) for
    unsigned INT8."""
    if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= 64:
        raise ValueError(f"bits must be an integer in [1, 64], got {bits!r}")
    if signed:
        return -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return 0, (1 << bits) - 1


def symmetric_qmax(bits: int) -> int:
    """Largest magnitude of a symmetric signed grid (7 for INT4, 127 for INT8): the top of
    `int_range`, so that -qmax..qmax is symmetric."""
    return int_range(bits)[1]
