"""Parameter evidence taken once at attach: the health of each hooked module's weights, scales
and zero points, its static input scale, and which parameters of the model are tied.

Everything is vectorised torch on the tensor's own device with a handful of host reads per
tensor (never a Python loop over rows, channels or groups). Full-tensor counts (NaN, Inf, exact
zeros) read every value once; the per-group summaries (distinct levels, scale dominance) read
at most `SAMPLE_ROWS` evenly spaced rows, so their cost is bounded whatever the model size.
The JSON keys written here are specified in docs/trace-format.md (module `info.health`,
`info.static_input`, root `info.tied`); the torch-free reader side is
`qforensics.trace.moduleinfo`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn

from qforensics.formats import canonical_format, canonical_layout, number_format
from qforensics.layouts.bits import unpack_awq, unpack_bits
from qforensics.layouts.torch_adapters import FP8_TORCH_DTYPES

__all__ = ["DOMINANCE_RATIO", "SAMPLE_ROWS", "param_health", "static_input", "tied_groups"]

SAMPLE_ROWS = 32  # rows read for the per-group summaries (levels, dominance)
DEFAULT_GROUP = 128  # quantization group along the input dim when the module names none
DOMINANCE_RATIO = 2.0  # a group's absmax >= this x its second-largest |value|: one weight sets
# the group's scale and every other weight in it uses at most half of the grid
FP8_DTYPES = FP8_TORCH_DTYPES  # torch's FP8 dtypes, by the names of qforensics.formats
ZERO_POINT_NAMES = ("weight_zero_point", "zeros", "input_zero_point", "zero_point")
SCALE_NAMES = ("scales", "weight_scale", "input_scale", "SCB", "scale", "weight_scale_inv")


def _index(flat: int, shape: tuple[int, ...], group: int | None) -> dict[str, int]:
    """Row (dim 0) and column (last dim) of a row-major flat index, and the column's group."""
    cols = shape[-1] if len(shape) >= 2 else 1
    out = {"index": flat, "row": flat // max(1, math.prod(shape[1:]))}
    if len(shape) >= 2:
        out["col"] = flat % cols
        if group:
            out["group"] = out["col"] // group
    return out


def _first(mask: torch.Tensor) -> int:
    """Flat index of the first True (one host read)."""
    return int(mask.reshape(-1).to(torch.uint8).argmax())


def _group_stats(x: torch.Tensor, group: int) -> dict[str, Any] | None:
    """Distinct levels and scale dominance per group of `group` input columns, on sampled rows."""
    if x.dim() != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        return None
    n, k = x.shape
    g = group if 0 < group <= k and k % group == 0 else k
    idx = torch.linspace(0, n - 1, steps=min(n, SAMPLE_ROWS), device=x.device).round().long()
    v = x.index_select(0, idx).float().reshape(-1, g)
    v = v[torch.isfinite(v).all(dim=1)]
    if v.shape[0] == 0:
        return None
    s = v.sort(dim=1).values
    levels = (s[:, 1:] != s[:, :-1]).sum(dim=1) + 1
    if g >= 2:  # the two largest |values| are among the two smallest and two largest values
        ends = torch.cat([s[:, :2], s[:, -2:]], dim=1).abs()
        top2 = ends.topk(2, dim=1).values
        dom = (top2[:, 0] > 0) & (top2[:, 0] >= DOMINANCE_RATIO * top2[:, 1])
    else:
        dom = torch.zeros(v.shape[0], dtype=torch.bool, device=v.device)
    lmin, lmed, dshare = torch.stack([
        levels.min().float(), levels.float().median(), dom.float().mean()]).tolist()
    return {"group_size": g, "groups": int(v.shape[0]), "rows_sampled": int(idx.numel()),
            "levels_min": int(lmin), "levels_median": float(lmed),
            "dominated_share": round(float(dshare), 4)}


def packed_levels(qweight: torch.Tensor, bits: int, group: int, layout: str
                  ) -> dict[str, Any] | None:
    """Distinct codes per quantization group of a packed int32 `qweight` (GPTQ: [K * bits / 32,
    N], packed along K; AWQ: [K, N * bits / 32], packed along N), on at most `SAMPLE_ROWS`
    sampled packed columns. Codes map one-to-one onto a group's dequantized levels. The words
    are decoded by `qforensics.layouts.bits` (the one definition of both packings). `layout`:
    "awq-gemm" or "gptq" (or a name older traces carry for them, such as "awq")."""
    layout = canonical_layout(layout) or layout
    if qweight.dtype != torch.int32 or qweight.dim() != 2 or bits not in (2, 4, 8):
        return None
    if layout not in ("awq-gemm", "gptq"):
        return None
    if layout == "awq-gemm" and bits != 4:
        return None  # AWQ's interleaved order is defined for 4-bit codes only
    idx = torch.linspace(0, qweight.shape[1] - 1, steps=min(qweight.shape[1], SAMPLE_ROWS),
                         device=qweight.device).round().long()
    words = qweight.index_select(1, idx).cpu().numpy()  # one small copy: [rows, sampled cols]
    if layout == "gptq":  # K runs along the packed rows
        codes = unpack_bits(words, bits, axis=0)  # [K, cols]
    else:  # awq: K runs along rows already; each word holds 8 output channels
        codes = unpack_awq(words)  # [K, 8 * cols]
    k = codes.shape[0]
    g = group if 0 < group <= k and k % group == 0 else k
    v = np.sort(codes.T.reshape(-1, g), axis=1)
    levels = np.count_nonzero(v[:, 1:] != v[:, :-1], axis=1) + 1
    return {"group_size": g, "groups": int(v.shape[0]), "rows_sampled": int(idx.numel()),
            "levels_min": int(levels.min()), "levels_median": float(np.median(levels)),
            "dominated_share": 0.0, "packed": True}


def param_health(t: torch.Tensor, pname: str, *, group: int | None = None,
                 bits: int | None = None, summarize: bool = False) -> dict[str, Any]:
    """Counts over the whole tensor (`numel`, `nan`, `inf`, `zero`, `subnormal`), where the first
    bad value sits (`first_nonfinite`, and `first_zero` for a scale), and for a float weight with
    `summarize` the per-group `levels` summary; for an integer zero point the count outside the
    range its bit width allows (`zero_point_out_of_range`)."""
    if t.is_meta or t.numel() == 0:
        return {"numel": int(t.numel())}
    x = t.detach()
    leaf = pname.rsplit(".", 1)[-1]
    if not x.is_floating_point():
        out: dict[str, Any] = {"numel": int(x.numel())}
        if leaf in ZERO_POINT_NAMES and x.dtype not in (torch.bool,):
            b = bits or 8
            lo, hi = -(2 ** (b - 1)), 2 ** b - 1  # either signed or unsigned convention fits
            bad = (x < lo) | (x > hi)
            nbad = int(bad.count_nonzero())
            out["zero_point_out_of_range"] = nbad
            out["zero_point_range"] = [lo, hi]
            if nbad:
                out["first_out_of_range"] = _index(_first(bad), tuple(x.shape), None)
        return out
    if x.dtype in FP8_DTYPES:
        x = x.float()
    tiny = torch.finfo(x.dtype).tiny
    with torch.no_grad():  # count_nonzero on bool masks: ~3x faster than sum over 4 masks
        nan, fin, zero, small = torch.stack([
            torch.isnan(x).count_nonzero(), torch.isfinite(x).count_nonzero(),
            (x == 0).count_nonzero(), (x.abs() < tiny).count_nonzero(),
        ]).tolist()
        out = {"numel": int(x.numel()), "nan": nan, "inf": int(x.numel()) - fin - nan,
               "zero": zero, "subnormal": small - zero}
        is_scale = leaf in SCALE_NAMES
        if fin < x.numel():  # rare: find the first bad row / group
            out["first_nonfinite"] = _index(_first(~torch.isfinite(x)), tuple(x.shape),
                                            None if is_scale else group)
        if is_scale and zero:
            out["first_zero"] = _index(_first(x == 0), tuple(x.shape), None)
        if summarize and not is_scale and x.dim() == 2:
            levels = _group_stats(x, group or DEFAULT_GROUP)
            if levels is not None:
                out["levels"] = levels
    return out


def _scale_value(module: nn.Module) -> torch.Tensor | float | None:
    v = getattr(module, "input_scale", None)
    if isinstance(v, torch.Tensor) and v.numel() and v.is_floating_point() and not v.is_meta:
        return v
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    return None


# Kernels of vLLM's CPU build that keep activations in bf16/fp32 (W8A16): a checkpoint's
# static input scale is loaded but never applied.
_W8A16_KERNELS = ("CPUFp8PerTensorScaledMMLinearKernel", "CPUFp8BlockScaledMMKernel")


def _kernel_of(module: nn.Module) -> Any:
    """The GEMM kernel object a serving engine's layer runs (vLLM: `scheme.kernel` for
    compressed-tensors INT8, `scheme.fp8_linear` / `quant_method.fp8_linear` for FP8)."""
    for holder in (getattr(module, "scheme", None), getattr(module, "quant_method", None)):
        for attr in ("kernel", "fp8_linear"):
            k = getattr(holder, attr, None) if holder is not None else None
            if k is not None:
                return k
    return None


def input_scale_use(module: nn.Module) -> dict[str, Any]:
    """Whether the layer's kernel quantizes its input with the static `input_scale`, as far as
    the kernel object says: `applied` False, with the reason, for kernels that keep activations
    unquantized (W8A16) or quantize them per token at run time; True otherwise (our own layers
    and plain checkpoints apply it)."""
    k = _kernel_of(module)
    if k is None:
        return {"applied": True}
    name = type(k).__name__
    method = getattr(getattr(k, "linear_method", None), "__name__", "")
    out: dict[str, Any] = {"kernel": name + (f".{method.lstrip('_')}" if method else "")}
    if name in _W8A16_KERNELS or getattr(k, "apply_input_quant", True) is False:
        out.update(applied=False, why="the kernel keeps activations unquantized (W8A16)")
    elif method == "_apply_weights_sgl":
        out.update(applied=False, why="the kernel quantizes activations per token at run time "
                                      "(int8_scaled_mm_with_quant); input_scale is unused")
    else:
        out["applied"] = True
    return out


def _int8_kernel(module: nn.Module) -> bool:
    """An INT8 GEMM by its kernel's or scheme's class (vLLM's CPUInt8ScaledMMLinearKernel,
    compressed-tensors' W8A8Int8): symmetric INT8 has no zero point, and vLLM's oneDNN path
    hands the int8 weight to its handler, so neither tells the format."""
    holders = (_kernel_of(module), getattr(module, "scheme", None))
    return any("int8" in type(h).__name__.lower() for h in holders if h is not None)


def _zero_point(module: nn.Module) -> int | None:
    z = getattr(module, "input_zero_point", None)
    if isinstance(z, torch.Tensor) and z.numel() == 1 and not z.is_meta:
        return int(z.reshape(()).item())
    if isinstance(z, int) and not isinstance(z, bool):
        return z
    return None


def static_input(module: nn.Module, quant: dict[str, Any] | None) -> dict[str, Any] | None:
    """The static input scale a layer quantizes its activations with (`input_scale` of vLLM's
    and compressed-tensors' FP8/INT8 layers, and of our own static FP8 layer), and the range it
    can represent: scale x 448 for FP8 e4m3, x 57344 for e5m2, x 127 for INT8. With an INT8
    input zero point z (asymmetric), the representable inputs are [scale x (-128 - z),
    scale x (127 - z)], kept as `lo`/`hi`; `range` is then the larger of |lo| and hi, so an
    input beyond it saturates whatever its sign. `applied` says whether the kernel uses it."""
    v = _scale_value(module)
    if v is None:
        return None
    if isinstance(v, torch.Tensor):
        vals = v.detach().float().reshape(-1)
        lo, hi = torch.stack([vals.min(), vals.max()]).tolist()
        numel = int(vals.numel())
    else:
        lo = hi = v
        numel = 1
    q = quant or {}
    fmt = canonical_format(q.get("act_format")) or ""
    w = getattr(module, "weight", None)
    zp = _zero_point(module)
    if fmt not in ("int8", "fp8-e4m3", "fp8-e5m2"):
        fmt_hint = str(q.get("weight_format") or q.get("format") or "").lower()
        if "int8" in fmt_hint or zp is not None or _int8_kernel(module) or (
                isinstance(w, torch.Tensor) and w.dtype == torch.int8):
            fmt = "int8"
        elif "e5m2" in fmt_hint:
            fmt = "fp8-e5m2"
        else:
            fmt = "fp8-e4m3"
    qmax = number_format(fmt).max  # 127 for INT8 (symmetric), 448 for e4m3, 57344 for e5m2
    out = {"scale": hi, "scale_min": lo, "numel": numel, "format": fmt, "qmax": qmax,
           "range": hi * qmax}
    if fmt == "int8" and zp is not None and zp != 0 and numel == 1:
        r_lo, r_hi = hi * (-128 - zp), hi * (127 - zp)
        out.update(zero_point=zp, lo=r_lo, hi=r_hi, range=max(abs(r_lo), r_hi),
                   qmax=max(abs(r_lo), r_hi) / hi if hi else qmax)
    elif zp is not None:
        out["zero_point"] = zp
    out.update(input_scale_use(module))
    return out


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Parameter names that share one storage (e.g. `lm_head.weight` and
    `model.embed_tokens.weight`), each group in model order."""
    by_key: dict[tuple, list[str]] = {}
    try:
        named = model.named_parameters(remove_duplicate=False)
    except TypeError:  # very old torch
        named = model.named_parameters()
    for name, p in named:
        if p.is_meta:
            continue
        key = (p.untyped_storage().data_ptr(), p.storage_offset(), tuple(p.shape), p.dtype)
        by_key.setdefault(key, []).append(name)
    return [names for names in by_key.values() if len(names) > 1]
