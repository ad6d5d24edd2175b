"""Which modules capture hooks, and what it records about each one once (type, parameters,
quantization metadata, weight/scale health)."""

from __future__ import annotations

import json
from typing import Any, Callable, Iterable

import torch
from torch import nn

from qforensics.layerkinds import is_linear_like

_QUANT_ATTRS = ("qweight", "qzeros", "scales", "g_idx", "weight_scale", "input_scale",
                "weight_zero_point", "SCB")


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Decoder blocks: the entries of the largest ModuleList whose entries share one class."""
    best: list[tuple[str, nn.Module]] = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) >= 2:
            kinds = {type(m) for m in mod}
            if len(kinds) == 1 and len(mod) > len(best):
                prefix = f"{name}." if name else ""
                best = [(f"{prefix}{i}", m) for i, m in enumerate(mod)]
    return best


ModuleFilter = Callable[[str, nn.Module], bool]


def select_modules(model: nn.Module, modules: str | Iterable[str] | ModuleFilter | None = None,
                   ) -> list[tuple[str, nn.Module, str]]:
    """(name, module, kind) in model order; kind is linear | quantized_linear | block | root.

    `modules`: None or "default" (every linear-like module, every decoder block, the model
    output), "linear" (linears and the model output only), an iterable of module names, or a
    callable (name, module) -> bool.
    """
    blocks = {id(m) for _, m in find_blocks(model)}
    chosen: list[tuple[str, nn.Module, str]] = []
    names: set[str] | None = None
    fn: ModuleFilter | None = None
    mode = "default"
    if callable(modules):
        fn = modules
    elif isinstance(modules, str):
        mode = modules
        if mode not in ("default", "linear"):
            names = {modules}
    elif modules is not None:
        names = set(modules)
    for name, mod in model.named_modules():
        if mod is model:
            continue
        lin = is_linear_like(mod)
        kind = ("quantized_linear" if lin and _quant_meta(mod) else "linear") if lin else (
            "block" if id(mod) in blocks else "")
        if names is not None:
            ok = name in names
            kind = kind or "other"
        elif fn is not None:
            ok = bool(fn(name, mod))
            kind = kind or "other"
        else:
            ok = bool(kind) and (mode == "default" or kind != "block")
        if ok:
            chosen.append((name, mod, kind))
    chosen.append(("", model, "root"))
    return chosen


def _quant_meta(module: nn.Module) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for attr in ("w_bit", "bits", "wbits"):
        v = getattr(module, attr, None)
        if isinstance(v, int):
            meta["bits"] = v
    for attr in ("group_size", "groupsize"):
        v = getattr(module, attr, None)
        if isinstance(v, int):
            meta["group_size"] = v
    tname = type(module).__name__
    if hasattr(module, "qweight"):
        meta["format"] = "awq" if "WQLinear" in tname else "gptq"
        qw = module.qweight
        if "bits" not in meta:
            meta["bits"] = 4
        sc = getattr(module, "scales", None)
        if isinstance(sc, torch.Tensor) and sc.dim() == 2 and "group_size" not in meta:
            k = qw.shape[0] if meta["format"] == "awq" else qw.shape[0] * 32 // meta["bits"]
            meta["group_size"] = k // max(1, sc.shape[0])
    elif "Linear4bit" in tname:
        meta.update(format="bitsandbytes-nf4", bits=4)
    elif "Linear8bitLt" in tname:
        meta.update(format="bitsandbytes-int8", bits=8)
    w = getattr(module, "weight", None)
    if isinstance(w, torch.Tensor) and w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        meta.update(format=f"fp8-{str(w.dtype).split('_')[1]}", bits=8)
    extra = getattr(module, "qforensics_quant", None)  # set by our own fake-quant wrappers
    if isinstance(extra, dict):
        meta.update({k: v for k, v in extra.items() if isinstance(v, (int, float, str, bool))})
    return meta


def _health(t: torch.Tensor) -> dict[str, int]:
    if t.is_meta or t.numel() == 0:
        return {"numel": int(t.numel())}
    if not (t.is_floating_point()):
        return {"numel": int(t.numel())}
    x = t.detach()
    if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        x = x.float()
    tiny = torch.finfo(x.dtype).tiny
    with torch.no_grad():  # count_nonzero on bool masks: ~3x faster than sum over 4 masks
        nan, fin, zero, small = torch.stack([
            torch.isnan(x).count_nonzero(), torch.isfinite(x).count_nonzero(),
            (x == 0).count_nonzero(), (x.abs() < tiny).count_nonzero(),
        ]).tolist()
    return {"numel": int(x.numel()), "nan": nan, "inf": int(x.numel()) - fin - nan,
            "zero": zero, "subnormal": small - zero}


_HEALTH_CACHE: dict[tuple[int, int, tuple[int, ...], int], dict[str, int]] = {}


def _health_cached(t: torch.Tensor) -> dict[str, int]:
    """Tied weights (lm_head / embedding) and re-attached captures count once."""
    if t.is_meta or t.device.type != "cpu":
        return _health(t)
    key = (t.data_ptr(), t._version, tuple(t.shape), id(t))
    hit = _HEALTH_CACHE.get(key)
    if hit is None:
        if len(_HEALTH_CACHE) > 4096:
            _HEALTH_CACHE.clear()
        hit = _HEALTH_CACHE[key] = _health(t)
    return hit


def describe_module(name: str, module: nn.Module, kind: str) -> dict[str, str]:
    params: dict[str, Any] = {}
    health: dict[str, Any] = {}
    tensors = list(module.named_parameters(recurse=False)) + list(
        module.named_buffers(recurse=False))
    if kind in ("linear", "quantized_linear"):
        for pname, t in tensors:
            params[pname] = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
            if pname in ("weight", "bias", "scales", "weight_scale", "input_scale") or (
                    pname in _QUANT_ATTRS):
                try:
                    health[pname] = _health_cached(t)
                except Exception as exc:  # odd tensor subclass: note it, go on
                    health[pname] = {"error": str(exc)[:200]}
    info = {"params": params, "quant": _quant_meta(module) or None, "health": health}
    return {"name": name, "type": type(module).__name__, "kind": kind,
            "info": json.dumps(info, sort_keys=True)}
