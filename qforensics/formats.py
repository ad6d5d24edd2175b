"""One source of truth, torch-free: the kinds of hooked module and the limits of number formats.

Module kinds are what capture writes into /modules/kind and what the analysis, what-if and guard
select on; the trace reader refuses any other value. Number formats are one table
(`NUMBER_FORMATS`: canonical name, bits, exponent/mantissa bits, largest finite value, smallest
normal and subnormal, dtype names) with one alias map (`canonical_format`), and weight layouts
one vocabulary (`LAYOUTS`, the names qforensics.layouts.detect returns) with the names older
traces carry mapped onto it (`canonical_layout`, `canonical_quant`). Every module that needs a
format's limit or name reads it from here; torch dtypes are mapped by name on the torch side
(qforensics.layouts.torch_adapters.TORCH_DTYPES).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# -- module kinds (/modules/kind) ----------------------------------------------------------------
KIND_LINEAR = "linear"  # a dense Linear (nn.Linear, Conv1D, ...)
KIND_QUANTIZED_LINEAR = "quantized_linear"  # a Linear whose weights a quantization library packs
KIND_BLOCK = "block"  # a decoder block
KIND_ROOT = "root"  # the model itself (its output holds the logits)
KIND_OTHER = "other"  # any other module a user asked for by name or filter
MODULE_KINDS: frozenset[str] = frozenset({KIND_LINEAR, KIND_QUANTIZED_LINEAR, KIND_BLOCK,
                                          KIND_ROOT, KIND_OTHER})
GEMM_KINDS: tuple[str, ...] = (KIND_LINEAR, KIND_QUANTIZED_LINEAR)  # modules that run a GEMM

# -- number formats: the one table -----------------------------------------------------------
@dataclass(frozen=True)
class NumberFormat:
    """One element format. `name` is its canonical name (what the trace and the analysis write);
    `aliases` are the other spellings that still read (torch / ml_dtypes dtype names, safetensors
    names, quant's short names, and names older traces carry)."""

    name: str
    kind: str  # "float" | "int"
    bits: int
    max: float  # largest finite value (overflow, or saturation, above it)
    min: float  # lowest finite value
    exponent_bits: int | None = None
    mantissa_bits: int | None = None
    min_normal: float | None = None  # smallest positive normal value (floats)
    min_subnormal: float | None = None  # smallest positive value; None: no subnormals
    dtype: str = ""  # torch's / ml_dtypes' / numpy's dtype name ("float8_e4m3fn")
    safetensors: str = ""  # the name safetensors headers use ("F8_E4M3")
    aliases: tuple[str, ...] = ()

    @property
    def min_exponent(self) -> int | None:
        """Exponent of the smallest normal value (-6 for e4m3fn, -14 for e5m2 and fp16)."""
        if self.min_normal is None:
            return None
        return int(math.log2(self.min_normal))


NUMBER_FORMATS: dict[str, NumberFormat] = {f.name: f for f in (
    # float8_e4m3fn: S.1111.110 is the largest finite (no infinities; S.1111.111 is NaN)
    NumberFormat("fp8-e4m3", "float", 8, 448.0, -448.0, 4, 3, 2.0 ** -6, 2.0 ** -9,
                 "float8_e4m3fn", "F8_E4M3", ("e4m3", "e4m3fn", "fp8-e4m3fn", "fp8_e4m3",
                                              "fp8_e4m3fn")),
    # float8_e5m2: S.11110.11 (IEEE-like: the all-ones exponent is Inf/NaN)
    NumberFormat("fp8-e5m2", "float", 8, 57344.0, -57344.0, 5, 2, 2.0 ** -14, 2.0 ** -16,
                 "float8_e5m2", "F8_E5M2", ("e5m2", "fp8_e5m2")),
    # float8_e8m0fnu: the MX scale format, powers of two only, unsigned, no zero
    NumberFormat("fp8-e8m0", "float", 8, 2.0 ** 127, 2.0 ** -127, 8, 0, 2.0 ** -127, None,
                 "float8_e8m0fnu", "F8_E8M0", ("e8m0", "e8m0fnu")),
    NumberFormat("fp16", "float", 16, 65504.0, -65504.0, 5, 10, 2.0 ** -14, 2.0 ** -24,
                 "float16", "F16", ("half", "f16")),
    # bfloat16: (2 - 2**-7) * 2**127
    NumberFormat("bf16", "float", 16, 3.3895313892515355e38, -3.3895313892515355e38, 8, 7,
                 2.0 ** -126, 2.0 ** -133, "bfloat16", "BF16", ()),
    NumberFormat("fp32", "float", 32, 3.4028234663852886e38, -3.4028234663852886e38, 8, 23,
                 2.0 ** -126, 2.0 ** -149, "float32", "F32", ("float", "f32")),
    NumberFormat("int8", "int", 8, 127.0, -128.0, dtype="int8", safetensors="I8"),
    NumberFormat("int4", "int", 4, 7.0, -8.0, dtype="int4"),
)}


def _alias_map() -> dict[str, str]:
    out: dict[str, str] = {}
    for f in NUMBER_FORMATS.values():
        for a in (f.name, f.dtype, f.safetensors, *f.aliases):
            if a:
                out[a.lower()] = f.name
    return out


_NUMBER_ALIASES = _alias_map()


def canonical_format(name: object) -> str | None:
    """The canonical name of an element format from any of its spellings ("float8_e4m3fn",
    "torch.float8_e4m3fn", "e4m3", "fp8-e4m3fn", "F8_E4M3" -> "fp8-e4m3"); None if unknown."""
    if not isinstance(name, str):
        return None
    return _NUMBER_ALIASES.get(name.strip().lower().removeprefix("torch."))


def number_format(name: str) -> NumberFormat:
    """The table row of an element format by any of its names; KeyError if unknown."""
    canon = canonical_format(name)
    if canon is None:
        raise KeyError(f"unknown number format {name!r}; known: {', '.join(NUMBER_FORMATS)}")
    return NUMBER_FORMATS[canon]


FP8_FORMAT_NAMES: tuple[str, ...] = ("fp8-e4m3", "fp8-e5m2")  # the FP8 element formats of weights and activations

# Named constants, read from the table (kept for the many callers that want one number).
E4M3_MAX = NUMBER_FORMATS["fp8-e4m3"].max
E5M2_MAX = NUMBER_FORMATS["fp8-e5m2"].max
FP16_MAX = NUMBER_FORMATS["fp16"].max
BF16_MAX = NUMBER_FORMATS["bf16"].max
E4M3_MIN_SUBNORMAL = float(NUMBER_FORMATS["fp8-e4m3"].min_subnormal)  # type: ignore[arg-type]
E5M2_MIN_SUBNORMAL = float(NUMBER_FORMATS["fp8-e5m2"].min_subnormal)  # type: ignore[arg-type]

# Largest finite value by the analyzer's format names (overflow limits).
FORMAT_LIMITS: dict[str, float] = {n: NUMBER_FORMATS[n].max for n in ("fp8-e4m3", "fp8-e5m2", "fp16")}
# Smallest positive (subnormal) value of each FP8 format: below half of it, a value rounds to 0.
FP8_MIN_SUBNORMAL: dict[str, float] = {
    n: float(NUMBER_FORMATS[n].min_subnormal) for n in FP8_FORMAT_NAMES}  # type: ignore[arg-type]


# -- weight layouts: the one vocabulary ---------------------------------------------------------
# name -> what it is (one spelling each). qforensics.layouts.detect returns these, capture
# records them (/modules info `layout`, and `quant.format` for a layer it finds quantized).
LAYOUTS: dict[str, str] = {
    "dense": "a float weight (no quantization)",
    "awq-gemm": "AWQ INT4, AutoAWQ's GEMM pack",
    "gptq": "GPTQ, packed along K",
    "ct-pack-quantized": "compressed-tensors pack-quantized (W4A16 and other int widths)",
    "fp8": "FP8 weight (e4m3 / e5m2) with per-tensor, per-channel or block scales",
    "int8": "INT8 weight with scales (W8A8)",
    "vllm-cpu-w4a16": "vLLM's CPU W4A16 repack of an AWQ/GPTQ layer",
    "vllm-cpu-w4a8": "vLLM's CPU W4A8 blocked repack (AMX)",
    "marlin": "Marlin's tile-order repack",
    "exllama": "exllama's shuffled GPTQ",
    "bitsandbytes-nf4": "bitsandbytes 4-bit (NF4 / FP4)",
    "bitsandbytes-int8": "bitsandbytes LLM.int8 (CB / SCB)",
    "quanto": "optimum-quanto QTensor weight",
}
# Names older traces (capture before the one vocabulary) and configs carry -> the layout name.
# The FP8 ones also name the weight's element format (LAYOUT_WEIGHT_FORMATS).
LAYOUT_ALIASES: dict[str, str] = {
    "awq": "awq-gemm",  # capture wrote "awq" for AutoAWQ's WQLinear_GEMM
    "fp8-e4m3fn": "fp8",  # capture wrote "fp8-" + the weight dtype's suffix
    "fp8-e4m3": "fp8",
    "fp8-e5m2": "fp8",
    "pack-quantized": "ct-pack-quantized",  # compressed-tensors' own format name
}
LAYOUT_WEIGHT_FORMATS: dict[str, str] = {"fp8-e4m3fn": "fp8-e4m3", "fp8-e4m3": "fp8-e4m3",
                                         "fp8-e5m2": "fp8-e5m2"}


def canonical_layout(name: object) -> str | None:
    """The layout name (a key of LAYOUTS) from a name old traces or configs carry ("awq" ->
    "awq-gemm", "fp8-e4m3fn" -> "fp8"); None if it names no layout."""
    if not isinstance(name, str):
        return None
    n = name.strip().lower()
    if n in LAYOUTS:
        return n
    return LAYOUT_ALIASES.get(n)


def canonical_quant(q: dict) -> dict:
    """A module's `quant` info with capture's names in the one vocabulary: `format` a layout
    name and, for FP8, `weight_format` the weight's element format. Only what capture wrote (no
    `target`) is renamed: our own fake-quant layers record a scheme spec ("fp8-e4m3-nosat")
    with a `target`, left as it is."""
    fmt = q.get("format")
    if "target" in q or not isinstance(fmt, str):
        return q
    canon = canonical_layout(fmt)
    if canon is None or canon == fmt:
        return q
    out = {**q, "format": canon}
    wf = LAYOUT_WEIGHT_FORMATS.get(fmt.strip().lower())
    if wf and "weight_format" not in out:
        out["weight_format"] = wf
    return out


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
