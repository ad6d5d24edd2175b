"""Integer round-to-nearest (RTN) fake quantization: INT4 / INT8, symmetric.

Fake quantization means quantize-then-dequantize: the result has the input's dtype, device and
shape, but every value lies on the integer grid ``q * scale`` with ``q`` in ``[-qmax, qmax]``
(``qmax`` = 7 for INT4, 127 for INT8). Everything is vectorized; no Python loop ever runs over
channels, tokens or groups.

Granularity (one scale per ...):

- ``per-tensor``: the whole tensor (for activations: dynamic per-tensor).
- ``per-channel``: each slice along the last dim, i.e. each output row of a ``[N, K]`` torch
  ``Linear`` weight.
- ``per-token``: the same reduction applied to an activation ``[..., tokens, hidden]``: one scale
  per token (dynamic per-token).
- ``group``: consecutive runs of ``group_size`` elements along the last dim (the input dim K of a
  weight). When K is not a multiple of ``group_size`` the last group of each row is shorter and
  gets its own scale from its own elements only.

Scales are ``absmax / qmax`` computed in float32 (float64 for float64 input) and floored at the
smallest normal float, so a scale is never zero: an all-zero group gives exact zeros, never NaN,
and exact zeros stay zero everywhere. Rounding is half-to-even (``torch.round``), deterministic.
Non-finite input is not hidden: a NaN or Inf in a group makes that group's scale non-finite and
its output NaN, as a real absmax-based kernel would.
"""

from __future__ import annotations

from typing import Literal

import torch

from qforensics.formats import symmetric_qmax
from qforensics.quant.errors import QuantSchemeError

Granularity = Literal["per-tensor", "per-channel", "per-token", "group"]

GRANULARITIES: tuple[str, ...] = ("per-tensor", "per-channel", "per-token", "group")

__all__ = ["GRANULARITIES", "Granularity", "fake_quant_int", "int_qmax", "int_scales"]


def int_qmax(bits: int) -> int:
    """Largest integer magnitude of a symmetric signed ``bits``-bit grid (7 for 4, 127 for 8)."""
    if bits not in (4, 8):
        raise QuantSchemeError(f"integer fake-quant supports bits 4 or 8, not {bits!r}")
    return symmetric_qmax(bits)


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype quantization arithmetic runs in: float64 stays float64, all else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_float(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"fake quantization needs a floating-point tensor, got {got}")


def _check_granularity(granularity: str, group_size: int | None) -> int:
    if granularity not in GRANULARITIES:
        raise QuantSchemeError(
            f"unknown granularity {granularity!r}; valid: {', '.join(GRANULARITIES)}"
        )
    if granularity == "group":
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
            raise QuantSchemeError(
                f"group granularity needs a positive integer group_size, got {group_size!r}"
            )
        return group_size
    return 0


def _rows(x: torch.Tensor, granularity: str, group_size: int) -> torch.Tensor:
    """View ``x`` as ``[rows, n]`` where each row shares one scale (group tails zero-padded)."""
    if granularity == "per-tensor" or x.dim() == 0:
        return x.reshape(1, -1)
    k = x.shape[-1]
    if granularity in ("per-channel", "per-token"):
        return x.reshape(-1, k)
    pad = (-k) % group_size
    if pad:
        # Zero padding never changes an absmax, so the tail group's scale comes from its own
        # (fewer) elements only; the padding is cut off again in _unrows.
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(-1, group_size)


def _unrows(rows: torch.Tensor, x: torch.Tensor, granularity: str) -> torch.Tensor:
    if granularity != "group" or x.dim() == 0:
        return rows.reshape(x.shape)
    k = x.shape[-1]
    return rows.reshape(*x.shape[:-1], -1)[..., :k]


def _row_scales(rows: torch.Tensor, qmax: int) -> torch.Tensor:
    amax = rows.abs().amax(dim=1, keepdim=True)
    # clamp keeps NaN (a NaN amax stays NaN) but lifts 0 and underflowed scales to `tiny`.
    return (amax / qmax).clamp(min=torch.finfo(rows.dtype).tiny)


def int_scales(
    x: torch.Tensor,
    bits: int = 4,
    granularity: Granularity = "per-tensor",
    group_size: int | None = None,
) -> torch.Tensor:
    """The scales ``fake_quant_int`` uses, in the work dtype (float32, or float64 for float64).

    Shapes: per-tensor ``[]``; per-channel / per-token ``x.shape[:-1]``; group
    ``(*x.shape[:-1], ceil(K / group_size))``. Never zero.
    """
    _check_float(x)
    qmax = int_qmax(bits)
    gs = _check_granularity(granularity, group_size)
    if x.numel() == 0:
        raise QuantSchemeError("cannot compute scales of an empty tensor")
    rows = _rows(x.detach().to(work_dtype(x.dtype)), granularity, gs)
    scales = _row_scales(rows, qmax)
    if granularity == "per-tensor" or x.dim() == 0:
        return scales.reshape(())
    if granularity == "group":
        return scales.reshape(*x.shape[:-1], -1)
    return scales.reshape(x.shape[:-1])


def fake_quant_int(
    x: torch.Tensor,
    bits: int = 4,
    granularity: Granularity = "per-tensor",
    group_size: int | None = None,
) -> torch.Tensor:
    """Symmetric RTN fake-quant of ``x`` to a signed ``bits``-bit grid; same dtype/device/shape.

    For every in-range value ``|x - fake_quant_int(x)| <= scale / 2`` (up to float rounding of
    the dequantized product) with ``scale`` from :func:`int_scales`.
    """
    _check_float(x)
    qmax = int_qmax(bits)
    gs = _check_granularity(granularity, group_size)
    if x.numel() == 0:
        return x.clone()
    rows = _rows(x.to(work_dtype(x.dtype)), granularity, gs)
    scale = _row_scales(rows, qmax)
    q = torch.clamp(torch.round(rows / scale), -qmax, qmax) * scale
    return _unrows(q, x, granularity).to(x.dtype)
