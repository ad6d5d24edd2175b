"""Which modules capture hooks, and what it records about each one once (type, parameters,
quantization metadata, weight/scale health)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from qforensics.formats import (
    FP8_FORMAT_NAMES,
    GEMM_KINDS,
    KIND_BLOCK,
    KIND_LINEAR,
    KIND_OTHER,
    KIND_QUANTIZED_LINEAR,
    KIND_ROOT,
    canonical_format,
)
from qforensics.hooks.params import (
    packed_levels,
    param_health,
    static_input,
    tied_groups,
)

from qforensics.layerkinds import is_linear_like
from qforensics.layouts.detect import detect
from qforensics.trace.layout import json_attr

_QUANT_ATTRS = ("qweight", "qzeros", "scales", "g_idx", "weight_scale", "input_scale",
                "weight_zero_point", "SCB")
HEALTH_PARAMS = ("weight", "bias", "qweight", "qzeros", "scales", "weight_scale",
                  "weight_scale_inv", "input_scale", "weight_zero_point", "input_zero_point",
                  "zeros", "SCB")


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
    """(name, module, kind) in model order; kind is one of qforensics.formats.MODULE_KINDS.

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
        kind = (KIND_QUANTIZED_LINEAR if lin and quant_meta(mod) else KIND_LINEAR) if lin else (
            KIND_BLOCK if id(mod) in blocks else "")
        if names is not None:
            ok = name in names
            kind = kind or KIND_OTHER
        elif fn is not None:
            ok = bool(fn(name, mod))
            kind = kind or KIND_OTHER
        else:
            ok = bool(kind) and (mode == "default" or kind != KIND_BLOCK)
        if ok:
            chosen.append((name, mod, kind))
    chosen.append(("", model, KIND_ROOT))
    return chosen


def quant_meta(module: nn.Module) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for attr in ("w_bit", "bits", "wbits"):
        v = getattr(module, attr, None)
        if isinstance(v, int):
            meta["bits"] = v
    for attr in ("group_size", "groupsize"):
        v = getattr(module, attr, None)
        if isinstance(v, int):
            meta["group_size"] = v
    # a serving engine's layer states its quantization config (vLLM: quant_method.quant_config);
    # its loaded tensors may be repacked, so shapes would mislead
    qcfg = getattr(getattr(module, "quant_method", None), "quant_config", None)
    for attr, key in (("group_size", "group_size"), ("weight_bits", "bits")):
        v = getattr(qcfg, attr, None)
        if isinstance(v, int) and not isinstance(v, bool) and key not in meta:
            meta[key] = v
    tname = type(module).__name__
    # `format`: the layout's name in the one vocabulary (qforensics.formats.LAYOUTS), as the
    # detector (qforensics.layouts.detect) names the layer's checkpoint packing; FP8 adds the
    # weight's element format (`weight_format`, a canonical number format name)
    if hasattr(module, "qweight"):
        if "bits" not in meta:
            meta["bits"] = 4
        meta["format"] = _packing(module, tname, meta["bits"])
        qw = module.qweight
        sc = getattr(module, "scales", None)
        if isinstance(sc, torch.Tensor) and sc.dim() == 2 and "group_size" not in meta:
            k = qw.shape[0] if meta["format"] == "awq-gemm" else qw.shape[0] * 32 // meta["bits"]
            meta["group_size"] = k // max(1, sc.shape[0])
    elif "Linear4bit" in tname:
        meta.update(format="bitsandbytes-nf4", bits=4)
    elif "Linear8bitLt" in tname:
        meta.update(format="bitsandbytes-int8", bits=8)
    w = getattr(module, "weight", None)
    wfmt = canonical_format(str(w.dtype)) if isinstance(w, torch.Tensor) else None
    if wfmt in FP8_FORMAT_NAMES:
        meta.update(format="fp8", weight_format=wfmt, bits=8)
    if wfmt == "int8" and "format" not in meta:
        meta.update(format="int8", bits=8)
    sc = getattr(module, "input_scale", None)
    if isinstance(sc, (torch.Tensor, float)) and not isinstance(sc, bool):
        meta["activations"] = "static"  # quantizes its input with a fixed scale
    extra = getattr(module, "qforensics_quant", None)  # set by our own fake-quant wrappers
    if isinstance(extra, dict):
        meta.update({k: v for k, v in extra.items() if isinstance(v, (int, float, str, bool))})
    return meta


def _packing(module: nn.Module, tname: str, bits: int) -> str:
    """"awq-gemm" or "gptq": the detector's name for a `qweight` layer's packing, from its class
    and its tensors' shapes (never an engine's repack: that is the info's `layout`); "gptq"
    when the shapes fit neither, as capture always said for a non-AutoAWQ layer."""
    tensors = {n: getattr(module, n) for n in ("qweight", "scales", "g_idx")
               if isinstance(getattr(module, n, None), torch.Tensor)}
    try:
        name = detect(tensors, tname, bits=bits if bits in (2, 4, 8) else None).name
    except Exception:  # noqa: BLE001 - odd shapes: fall back, never break the host run
        name = ""
    return name if name in ("awq-gemm", "gptq") else "gptq"


_HEALTH_CACHE: dict[tuple, dict[str, Any]] = {}


def _health_cached(t: torch.Tensor, pname: str, **kw: Any) -> dict[str, Any]:
    """Tied weights (lm_head / embedding) count once per attach. Cleared when the root (always
    described last) is: a weight changed through `.data` between captures keeps its `_version`,
    so a cache across attaches could serve stale counts."""
    if t.is_meta or t.device.type != "cpu":
        return param_health(t, pname, **kw)
    key = (t.data_ptr(), t._version, tuple(t.shape), id(t), pname, tuple(sorted(kw.items())))
    hit = _HEALTH_CACHE.get(key)
    if hit is None:
        if len(_HEALTH_CACHE) > 4096:
            _HEALTH_CACHE.clear()
        hit = _HEALTH_CACHE[key] = param_health(t, pname, **kw)
    return hit


def describe_module(name: str, module: nn.Module, kind: str) -> dict[str, str]:
    """One /modules row: type, kind and the `info` JSON (params, quant, layout, health,
    static_input; for the root, `tied`). Never raises for an odd tensor: the error is noted instead."""
    params: dict[str, Any] = {}
    health: dict[str, Any] = {}
    tensors = list(module.named_parameters(recurse=False)) + list(
        module.named_buffers(recurse=False))
    quant = quant_meta(module) or None
    info: dict[str, Any] = {"params": params, "quant": quant, "health": health}
    if kind in GEMM_KINDS:
        group = (quant or {}).get("group_size")
        bits = (quant or {}).get("bits")
        for pname, t in tensors:
            params[pname] = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
            if pname in HEALTH_PARAMS:
                try:
                    health[pname] = _health_cached(
                        t, pname, group=group if isinstance(group, int) else None,
                        bits=bits if isinstance(bits, int) else None,
                        summarize=pname == "weight")
                except Exception as exc:  # noqa: BLE001 - odd tensor subclass: note it, go on
                    health[pname] = {"error": str(exc)[:200]}
        try:  # the one detector's name for the layer's layout (qforensics.layouts)
            from qforensics.layouts.torch_adapters import detect_module

            info["layout"] = detect_module(module).name
        except Exception as exc:  # noqa: BLE001 - an odd layer: note it, go on
            info["layout_error"] = str(exc)[:200]
        q = quant or {}
        if "qweight" in health and q.get("format") in ("awq-gemm", "gptq") and "error" not in health[
                "qweight"]:
            try:
                lv = packed_levels(module.qweight, int(q.get("bits", 4)),
                                   int(q.get("group_size", 128)), str(q["format"]))
                if lv is not None:  # a copy: the cached dict stays as counted
                    health["qweight"] = {**health["qweight"], "levels": lv}
            except Exception as exc:  # noqa: BLE001 - an odd packing: note it, go on
                health["qweight"]["levels_error"] = str(exc)[:200]
        try:
            st = static_input(module, quant)
        except Exception as exc:  # noqa: BLE001 - never break the host run
            st = {"error": str(exc)[:200]}
        if st is not None:
            info["static_input"] = st
    elif kind == "root":
        try:
            emb = input_embedding(module)
            if emb is not None:  # before the clear: a tied lm_head already counted its weight
                info["embedding"] = {"name": emb[0], "health": {"weight": _health_cached(
                    emb[1].weight, "weight", group=None, bits=None, summarize=True)}}
        except Exception as exc:  # noqa: BLE001 - an odd embedding: note it, go on
            info["embedding"] = {"error": str(exc)[:200]}
        _HEALTH_CACHE.clear()  # the root comes last: the cache serves one attach (tied weights)
        try:
            info["tied"] = tied_groups(module)[:64]
        except Exception as exc:  # noqa: BLE001
            info["tied_error"] = str(exc)[:200]
    return {"name": name, "type": type(module).__name__, "kind": kind,
            "info": json_attr(info)}


def input_embedding(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The token embedding capture does not hook (its output is the first layer's input, so
    a corrupt row shows up as NaN arriving from an unhooked op): the first module whose class
    is an embedding with a 2-D weight (HF nn.Embedding, vLLM's VocabParallelEmbedding; rotary
    "embeddings" have no weight). Its weight's health goes into the root's info."""
    for name, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if ("Embedding" in type(mod).__name__ and isinstance(w, torch.Tensor) and w.dim() == 2
                and not w.is_meta and w.numel()):
            return name, mod
    return None


def io_width(m: nn.Module) -> int:
    """Input plus output features of a linear-like layer (0 when it does not say). Read from
    the layer's own sizes first: vLLM's CPU linears keep an empty `weight` once their weights
    are repacked for oneDNN (shape (0,)), and packed quantized weights have other shapes."""
    for a, b in (("in_features", "out_features"), ("input_size", "output_size")):
        i, o = getattr(m, a, None), getattr(m, b, None)
        if isinstance(i, int) and isinstance(o, int) and i > 0 and o > 0:
            return i + o
    w = getattr(m, "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() == 2:
        return int(w.shape[0]) + int(w.shape[1])
    return 0


def ring_chunk(modules: list[nn.Module]) -> int:
    """Ring chunk width for the trace writer: about a quarter of a step's channel block, which
    holds roughly every hooked layer's input and output widths (a power of two, 4096-65536).
    Each chunk of a ring slot is one HDF5 call per step: a width guessed too small (it was 4096
    for vLLM's repacked linears: 67 calls a slot) costs more than the bytes."""
    width = sum(io_width(m) for m in modules)
    chunk = 4096
    while chunk < 65536 and chunk * 4 < width:
        chunk *= 2
    return chunk
