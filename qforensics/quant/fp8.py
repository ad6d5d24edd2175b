"""FP8 fake quantization (OCP e4m3 / e5m2) and a probe of this torch's FP8 cast.

Rounding onto the FP8 grid is done here, in float32 arithmetic (float64 for float64 input), with
round-half-to-even: the result never depends on what this torch build does when it casts an
out-of-range value to ``torch.float8_*`` (that differs between versions and devices; see
:func:`probe_fp8_cast`).

Formats (``FP8_FORMATS``):

- ``e4m3`` (``float8_e4m3fn``): 3 mantissa bits, smallest normal exponent -6, max 448.
- ``e5m2`` (``float8_e5m2``): 2 mantissa bits, smallest normal exponent -14, max 57344.

Overflow, for ``|x / scale| > max``:

- ``saturate=True``: clamp to ``±max`` (also for ``±inf``); finite input never gives NaN.
- ``saturate=False``: NaN, exactly where ``|x / scale| > max`` (and for ``±inf``), as a
  non-saturating conversion into e4m3fn does. For e5m2, hardware would give ``±inf``; this
  emulation gives NaN for both formats, so "out of FP8 range" has one observable signature.

NaN input stays NaN. Scale: ``None`` or ``1.0`` (static, the common default for activations),
any positive float (static), or ``"dynamic"``: per-tensor ``amax / max``, never zero. A dynamic
scale maps the tensor into range by construction, so then only ``±inf`` input overflows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from qforensics.formats import FP8_FORMAT_NAMES, NUMBER_FORMATS, canonical_format
from qforensics.quant.errors import QuantSchemeError
from qforensics.quant.integer import work_dtype

__all__ = ["FP8_FORMATS", "FP8Format", "fake_quant_fp8", "probe_fp8_cast", "round_to_fp8_grid"]

FP8Name = Literal["e4m3", "e5m2"]


@dataclass(frozen=True)
class FP8Format:
    """One FP8 format: mantissa bits, smallest normal exponent, largest finite value."""

    name: str
    mantissa_bits: int
    min_exponent: int
    max: float
    torch_dtype: str

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.min_exponent - self.mantissa_bits)


def _row(canonical: str) -> FP8Format:
    f = NUMBER_FORMATS[canonical]  # the one table (qforensics.formats)
    return FP8Format(canonical.removeprefix("fp8-"), f.mantissa_bits, f.min_exponent, f.max,
                     f.dtype)  # type: ignore[arg-type]


# keyed by the short names schemes use ("e4m3", "e5m2"), an alias of each table row
FP8_FORMATS: dict[str, FP8Format] = {
    _row(n).name: _row(n) for n in FP8_FORMAT_NAMES}


def _format(fmt: str) -> FP8Format:
    """The format by any of its names ("e4m3", "e4m3fn", "fp8-e4m3", "float8_e4m3fn")."""
    canon = canonical_format(fmt)
    if canon not in FP8_FORMAT_NAMES:
        raise QuantSchemeError(f"unknown FP8 format {fmt!r}; valid: {', '.join(FP8_FORMATS)}")
    return FP8_FORMATS[canon.removeprefix("fp8-")]  # type: ignore[union-attr]


def _pow2(exponent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Exact ``2.0 ** exponent`` for integer exponents in the normal range, via the bit pattern."""
    if dtype == torch.float64:
        return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


def round_to_fp8_grid(x: torch.Tensor, fmt: FP8Name = "e4m3") -> torch.Tensor:
    """Round float32/float64 ``x`` to the nearest FP8 value (half-to-even), ignoring range.

    The caller handles overflow; values must be finite or NaN (NaN stays NaN). Subnormals are
    rounded onto the subnormal grid. Exact for ``|x|`` up to 2**100.
    """
    spec = _format(fmt)
    ax = x.abs()
    _, exp = torch.frexp(ax)  # ax = m * 2**exp with m in [0.5, 1); 0 for zero and non-finite
    exp = (exp - 1).clamp(min=spec.min_exponent, max=100)  # floor(log2 |x|), subnormals share emin
    quantum = _pow2(exp - spec.mantissa_bits, x.dtype)
    return torch.round(x / quantum) * quantum


def fake_quant_fp8(
    x: torch.Tensor,
    fmt: FP8Name = "e4m3",
    *,
    saturate: bool = True,
    scale: float | Literal["dynamic"] | None = None,
) -> torch.Tensor:
    """Fake-quantize ``x`` through FP8 ``fmt``; same dtype, device and shape as ``x``.

    For in-range values the error is at most half an FP8 ulp: ``|x - q| <=
    max(|x| * 2**-(m+1), min_subnormal / 2) * scale`` with ``m`` the mantissa bits.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"fake quantization needs a floating-point tensor, got {got}")
    spec = _format(fmt)
    if x.numel() == 0:
        return x.clone()
    wd = work_dtype(x.dtype)
    xw = x.to(wd)
    dynamic = scale == "dynamic"
    if dynamic:
        s = (xw.abs().amax() / spec.max).clamp(min=torch.finfo(wd).tiny)
        y = xw / s
    elif scale is None or scale == 1.0:
        s = None
        y = xw
    else:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (
            math.isfinite(scale) and scale > 0
        ):
            raise QuantSchemeError(
                f"FP8 scale must be a positive finite number, 'dynamic' or None, got {scale!r}"
            )
        s = torch.tensor(float(scale), dtype=wd, device=x.device)
        y = xw / s
    # With a dynamic scale |y| can exceed max only by the scale's own rounding: not an overflow.
    overflow = y.isinf() if dynamic else y.abs() > spec.max
    q = round_to_fp8_grid(y.clamp(-spec.max, spec.max), spec.name)  # type: ignore[arg-type]
    if not saturate:
        q = torch.where(overflow, torch.full_like(q, float("nan")), q)
    if s is not None:
        q = q * s
    return q.to(x.dtype)


def _classify(out: float, limit: float) -> str:
    if math.isnan(out):
        return "nan"
    if abs(out) == limit:
        return "saturate"
    return f"other:{out!r}"


_PROBES: dict[str, tuple[float, ...]] = {
    "e4m3": (1000.0, -1000.0, math.inf),
    "e5m2": (100000.0, -100000.0, math.inf),
}


def probe_fp8_cast() -> dict[str, Any]:
    """What THIS torch does when it eagerly casts out-of-range float32 on CPU into FP8.

    Returns ``{"torch": version, "e4m3fn": {"1000.0": r, "-1000.0": r, "inf": r},
    "e5m2": {"100000.0": r, "-100000.0": r, "inf": r}}`` with each ``r`` one of ``"nan"``,
    ``"saturate"`` (±max), ``"other:<value>"`` (e.g. ``"other:inf"``) or ``"unsupported"``
    (this torch lacks the dtype or the cast raised). Never raises.
    """
    result: dict[str, Any] = {"torch": str(getattr(torch, "__version__", "unknown"))}
    for name, spec in FP8_FORMATS.items():
        key = spec.torch_dtype.removeprefix("float8_")
        entry: dict[str, str] = {}
        for value in _PROBES[name]:
            label = repr(value)
            try:
                dtype = getattr(torch, spec.torch_dtype)
                src = torch.tensor([value], dtype=torch.float32)
                out = float(src.to(dtype).to(torch.float32).item())
                entry[label] = _classify(out, spec.max)
            except Exception:  # noqa: BLE001 - a probe reports, it never raises
                entry[label] = "unsupported"
        result[key] = entry
    return result
