"""Quantization of each hooked module, as capture recorded it in the module's info JSON (the
`quant` key: format, target, bits), and its weight layout as qforensics.layouts.detect names it
from the recorded tensors. Trace content is untrusted: the JSON is parsed with the validator's
bounds and every field is type-checked and capped. No torch import."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qforensics.errors import TraceFormatError
from qforensics.formats import canonical_quant
from qforensics.trace.moduleinfo import module_layout
from qforensics.trace.reader import Trace
from qforensics.trace.validate import parse_json

__all__ = ["ModuleQuant", "module_info_dict", "read_quant"]

MAX_INFO_BYTES = 1 << 20


def module_info_dict(raw: str) -> dict[str, Any] | None:
    """A module's info JSON as a dict: {} when empty, None when it is not a bounded JSON object."""
    if not raw:
        return {}
    try:
        d = parse_json(raw, "module info", max_bytes=MAX_INFO_BYTES)
    except TraceFormatError:
        return None
    return d if isinstance(d, dict) else None


# -- quantization per module -----------------------------------------------------------------------
@dataclass(frozen=True)
class ModuleQuant:
    format: str  # our fake quant's scheme ("fp8-e4m3-nosat", "int4-per-tensor"), or the layout
    # capture names (qforensics.formats.LAYOUTS: "awq-gemm", "fp8"; older names mapped)
    target: str  # "activations" | "weights" | ""
    bits: int | None
    layout: str = ""  # the weight layout, by qforensics.layouts.detect ("awq-gemm", "fp8", ...)


def read_quant(trace: Trace) -> dict[str, ModuleQuant]:
    """module name -> its quantization (from the `quant` key of the module's info JSON)."""
    out: dict[str, ModuleQuant] = {}
    cols = trace.module_columns
    for name, mtype, raw in zip(trace.module_names, cols["type"], cols["info"]):
        info = module_info_dict(raw)
        q = info.get("quant") if info else None
        if not isinstance(q, dict):
            continue
        q = canonical_quant(q)  # capture's older names ("awq", "fp8-e4m3fn") -> the one vocabulary
        fmt = q.get("format")
        if not isinstance(fmt, str) or not fmt:
            continue
        target = q.get("target") if isinstance(q.get("target"), str) else ""
        bits = q.get("bits") if isinstance(q.get("bits"), int) else None
        out[name] = ModuleQuant(fmt[:80], target[:40], bits, module_layout(mtype, info))
    return out
