"""Which quantized layout a layer holds: the one detector, and the one spelling of each name.

It reads only what a trace (or a checkpoint header) states about a layer: its tensors' names,
dtypes and shapes, the layer's class name, a quantization method from a config, and an engine's
own statement (vLLM's CPU kernels say at load whether they repacked to W4A16 or W4A8). The
names are `qforensics.formats.LAYOUTS`: the layout names of `qforensics.layouts.registry` plus
those the project recognises but does not decode itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qforensics.formats import LAYOUTS, canonical_layout
from qforensics.layouts import awq, gptq

__all__ = ["DECODED", "FORMATS", "Detected", "detect", "packed_method", "param_specs"]

# name -> what it is (one spelling each; the trace records these): the one vocabulary, kept in
# qforensics.formats so that capture, analyze and guard read the same names
FORMATS: dict[str, str] = LAYOUTS
# formats this package decodes (the others are decoded by their library, or refused)
DECODED = ("dense", "awq-gemm", "gptq", "ct-pack-quantized", "fp8", "vllm-cpu-w4a16")


@dataclass(frozen=True)
class Detected:
    name: str  # one of FORMATS, or "" when unknown
    why: str  # the evidence, in words


def _spec(v: Any) -> tuple[str, tuple[int, ...]]:
    if isinstance(v, Mapping):
        dt, shape = v.get("dtype"), v.get("shape")
    else:
        dt, shape = getattr(v, "dtype", None), getattr(v, "shape", None)
    try:
        dims = tuple(int(d) for d in shape) if shape is not None else ()
    except (TypeError, ValueError):
        dims = ()
    return str(dt or "").replace("torch.", "").lower(), dims


def param_specs(params: Mapping[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype name, shape) from tensors, arrays, or the trace's {"dtype", "shape"}."""
    return {str(k): _spec(v) for k, v in params.items()}


def packed_method(qweight: tuple[int, ...], scales: tuple[int, ...], bits: int = 4,
                  has_g_idx: bool = False) -> str | None:
    """"awq-gemm" or "gptq" from the shapes of qweight and scales (None: neither fits)."""
    if has_g_idx and gptq.shape_problem(qweight, None, scales, bits) is None:
        return "gptq"
    if len(qweight) == 2 and len(scales) == 2 and qweight[1] == scales[1]:
        return "gptq"
    if len(qweight) == 2 and len(scales) == 2 and 32 // bits * qweight[1] == scales[1]:
        return "awq-gemm" if bits != 4 or awq.shape_problem(qweight, None, scales) is None else None
    return None


def detect(params: Mapping[str, Any], module_type: str = "", *, method: str | None = None,
           engine_layout: str | None = None, bits: int | None = None) -> Detected:
    """The layout of one layer. `params`: its tensors (or their dtype/shape); `method`: a
    config's quant_method ("awq", "gptq", "fp8", "compressed-tensors"); `engine_layout`: what
    the engine said it holds (vLLM CPU: "vllm-cpu-w4a16" / "vllm-cpu-w4a8")."""
    p = param_specs(params)
    mt = module_type or ""
    if engine_layout in FORMATS:
        return Detected(engine_layout, "the engine states it")
    for tag, name in (("Marlin", "marlin"), ("Exllama", "exllama"), ("Linear4bit", "bitsandbytes-nf4"),
                      ("Linear8bitLt", "bitsandbytes-int8")):
        if tag in mt:
            return Detected(name, f"layer class {mt}")
    if "weight_packed" in p:
        return Detected("ct-pack-quantized", "it holds weight_packed")
    if "qweight" in p:
        said = canonical_layout(method)  # a config's "awq" names the layout "awq-gemm"
        if "WQLinear" in mt or said == "awq-gemm":
            return Detected("awq-gemm", f"layer class {mt}" if "WQLinear" in mt else "the config says awq")
        if said == "gptq":
            return Detected("gptq", "the config says gptq")
        if "scales" in p:
            got = packed_method(p["qweight"][1], p["scales"][1], bits or 4, "g_idx" in p)
            if got:
                return Detected(got, f"qweight {list(p['qweight'][1])} against scales {list(p['scales'][1])}")
        return Detected("", f"qweight {list(p['qweight'][1])} fits neither AWQ [K, N/8] nor GPTQ [K/8, N]")
    wdt = p.get("weight", ("", ()))[0]
    if wdt.startswith("float8"):
        return Detected("fp8", f"weight is {wdt}")
    if "SCB" in p:
        return Detected("bitsandbytes-int8", "it holds SCB")
    if wdt == "int8" and ("weight_scale" in p or "scales" in p):
        return Detected("int8", "an int8 weight with scales")
    if mt == "QLinear" or "quanto" in mt.lower():
        return Detected("quanto", f"layer class {mt}")
    if wdt.startswith(("float", "bfloat")):
        return Detected("dense", f"weight is {wdt}")
    return Detected("", "no weight tensor this detector knows")
