"""Outlier-protected (salient-channel) weight quantization, AWQ-style.

A few input channels of a Linear carry activations orders of magnitude larger than the rest
(SmolLM2-135M: ~3000 in ``model.layers.11.mlp.down_proj`` channels 1229 and 1487). Errors in the
weight columns that multiply them are amplified by that magnitude. Protection keeps those
columns of ``W`` ([N, K], K = input channels) in FP16 and quantizes the rest to INT (group-wise
by default); the kept columns are also left out of the scale computation, so they no longer
inflate their groups' scales.

Pick the channels with `select_salient_channels` from per-input-channel activation absmax, which
`qforensics.quant.model.collect_input_absmax` gathers for every Linear in one calibration pass.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from qforensics.quant.errors import QuantSchemeError
from qforensics.quant.integer import Granularity, fake_quant_int, work_dtype

__all__ = ["quantize_weight_salient", "select_salient_channels"]


def select_salient_channels(act_absmax: torch.Tensor, fraction: float = 0.01) -> torch.Tensor:
    """Indices (int64, ascending) of the top ``fraction`` input channels by activation absmax.

    ``act_absmax`` is 1-D, one value per input channel. At least one channel is returned
    (``ceil(fraction * K)``, capped at K). NaN counts as the largest value: a channel whose
    activations went NaN is the one to look at. Ties go to the lower index (deterministic).
    """
    if not isinstance(act_absmax, torch.Tensor) or act_absmax.dim() != 1 or act_absmax.numel() == 0:
        raise QuantSchemeError("act_absmax must be a non-empty 1-D tensor (one value per channel)")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not (
        0.0 < fraction <= 1.0
    ):
        raise QuantSchemeError(f"fraction must be in (0, 1], got {fraction!r}")
    k = act_absmax.numel()
    count = min(k, max(1, math.ceil(fraction * k - 1e-9)))
    values = torch.nan_to_num(act_absmax.detach().double().abs(), nan=math.inf)
    # stable descending sort: equal values keep index order, so ties pick the lower index
    order = torch.sort(values, descending=True, stable=True).indices
    return torch.sort(order[:count]).values.to(torch.int64)


def quantize_weight_salient(
    weight: torch.Tensor,
    salient_channels: torch.Tensor | Sequence[int],
    *,
    bits: int = 4,
    granularity: Granularity = "group",
    group_size: int | None = 128,
) -> torch.Tensor:
    """Fake-quant ``weight`` ([..., K]) with columns ``salient_channels`` kept in FP16.

    The salient columns are rounded through float16 (values beyond ±65504 become ±inf, as an
    FP16 copy would) and excluded from the scales; all other columns are INT ``bits`` fake-quant
    with ``granularity`` / ``group_size``. Same dtype, device and shape as ``weight``.
    """
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() < 1:
        raise TypeError("quantize_weight_salient needs a floating-point tensor with >= 1 dim")
    k = weight.shape[-1]
    idx = torch.as_tensor(salient_channels, dtype=torch.int64, device=weight.device).reshape(-1)
    if idx.numel() and (int(idx.min()) < -k or int(idx.max()) >= k):
        raise QuantSchemeError(
            f"salient channel index out of range for {k} input channels "
            f"(got min {int(idx.min())}, max {int(idx.max())})"
        )
    idx = torch.remainder(idx, k)
    wd = work_dtype(weight.dtype)
    work = weight.to(wd)
    rest = work.index_fill(-1, idx, 0.0)
    q = fake_quant_int(rest, bits, granularity, group_size)
    kept = work.index_select(-1, idx).to(torch.float16).to(wd)
    return q.index_copy(-1, idx, kept).to(weight.dtype)
