"""The validated view of the `/modules` `info` JSON: parameter health, static input scales,
quantization and tied parameters (docs/trace-format.md, "Module info").

The JSON comes from an untrusted file: every value is type-checked, counts must be non-negative
integers, indexes are bounded by the tensor's size, strings are capped, and anything malformed is
dropped and counted in `ModuleInfos.invalid` rather than trusted. No torch import.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from qforensics.formats import canonical_format, canonical_quant
from qforensics.layouts.detect import FORMATS, detect
from qforensics.trace.reader import Trace

__all__ = ["BadIndex", "GroupLevels", "ModuleInfos", "ParamHealth", "StaticInput", "module_layout",
           "read_module_infos", "read_module_quant"]

_MAX_NAME = 200
_MAX_INT = 2 ** 62


def _count(v: Any, hi: int = _MAX_INT) -> int | None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v > hi:
        return None
    return v


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def _name(v: Any) -> str:
    return v[:_MAX_NAME] if isinstance(v, str) else ""


@dataclass(frozen=True)
class BadIndex:
    """Where the first bad value of a tensor sits: flat index, row (dim 0), column (last dim)
    and quantization group of that column (None when not applicable)."""

    index: int
    row: int
    col: int | None = None
    group: int | None = None

    def words(self) -> str:
        s = f"row {self.row}"
        if self.col is not None:
            s += f", column {self.col}"
        if self.group is not None:
            s += f" (group {self.group})"
        return s


@dataclass(frozen=True)
class GroupLevels:
    group_size: int
    groups: int
    rows_sampled: int
    levels_min: int
    levels_median: float
    dominated_share: float


@dataclass(frozen=True)
class ParamHealth:
    module: str
    param: str
    numel: int
    nan: int = 0
    inf: int = 0
    zero: int = 0
    subnormal: int = 0
    first_nonfinite: BadIndex | None = None
    first_zero: BadIndex | None = None
    levels: GroupLevels | None = None
    zero_point_out_of_range: int = 0
    first_out_of_range: BadIndex | None = None
    error: str | None = None

    @property
    def is_scale(self) -> bool:
        return self.param.rsplit(".", 1)[-1] in ("scales", "weight_scale", "input_scale", "SCB",
                                                 "scale", "weight_scale_inv")

    @property
    def zero_share(self) -> float:
        return self.zero / self.numel if self.numel else 0.0


@dataclass(frozen=True)
class StaticInput:
    """A layer's static input scale and the largest |input| it represents (scale x qmax)."""

    module: str
    scale: float
    scale_min: float
    format: str
    qmax: float
    range: float
    applied: bool = True  # False: the layer's kernel does not quantize with it (`why`)
    kernel: str = ""
    why: str = ""
    lo: float | None = None  # asymmetric INT8: the representable inputs [lo, hi]
    hi: float | None = None
    zero_point: int | None = None


@dataclass
class ModuleInfos:
    health: list[ParamHealth] = field(default_factory=list)
    static_inputs: dict[str, StaticInput] = field(default_factory=dict)
    quant: dict[str, dict[str, Any]] = field(default_factory=dict)
    # module -> its weight layout, named by qforensics.layouts.detect (one spelling per format)
    layouts: dict[str, str] = field(default_factory=dict)
    tied: list[list[str]] = field(default_factory=list)
    invalid: int = 0  # info values dropped as malformed
    # modules described (their health) but never hooked: the token embedding (root's info)
    unhooked: set[str] = field(default_factory=set)

    def tied_with(self, module: str, param: str) -> list[str]:
        """The other names of `module.param` when it is tied (e.g. the embedding for lm_head)."""
        full = f"{module}.{param}" if module else param
        for g in self.tied:
            if full in g:
                return [n for n in g if n != full]
        return []


def _bad_index(d: Any, numel: int) -> BadIndex | None:
    if not isinstance(d, dict):
        return None
    idx, row = _count(d.get("index"), max(0, numel - 1)), _count(d.get("row"), numel)
    if idx is None or row is None:
        return None
    col, grp = _count(d.get("col"), numel), _count(d.get("group"), numel)
    return BadIndex(idx, row, col, grp)


def _levels(d: Any) -> GroupLevels | None:
    if not isinstance(d, dict):
        return None
    gs, n = _count(d.get("group_size")), _count(d.get("groups"))
    rows = _count(d.get("rows_sampled"))
    lmin, lmed, dom = _count(d.get("levels_min")), _num(d.get("levels_median")), _num(
        d.get("dominated_share"))
    if None in (gs, n, rows, lmin, lmed, dom) or not (0.0 <= dom <= 1.0) or not math.isfinite(
            lmed):  # type: ignore[operator,arg-type]
        return None
    return GroupLevels(gs, n, rows, lmin, lmed, dom)  # type: ignore[arg-type]


def _health(module: str, pname: str, d: Any) -> ParamHealth | None:
    if not isinstance(d, dict):
        return None
    if "error" in d:
        return ParamHealth(module, pname, 0, error=str(d["error"])[:200])
    numel = _count(d.get("numel"))
    if numel is None:
        return None
    vals = {}
    for k in ("nan", "inf", "zero", "subnormal", "zero_point_out_of_range"):
        v = d.get(k, 0)
        c = _count(v, numel)
        if c is None:
            return None
        vals[k] = c
    if vals["nan"] + vals["inf"] > numel:
        return None
    return ParamHealth(module, pname, numel, vals["nan"], vals["inf"], vals["zero"],
                       vals["subnormal"], _bad_index(d.get("first_nonfinite"), numel),
                       _bad_index(d.get("first_zero"), numel), _levels(d.get("levels")),
                       vals["zero_point_out_of_range"],
                       _bad_index(d.get("first_out_of_range"), numel))


def _static(module: str, d: Any) -> StaticInput | None:
    if not isinstance(d, dict) or "error" in d:
        return None
    scale, smin, qmax, rng = (_num(d.get(k)) for k in ("scale", "scale_min", "qmax", "range"))
    fmt = d.get("format")
    if None in (scale, smin, qmax, rng) or not isinstance(fmt, str):
        return None
    if not all(math.isfinite(v) and v > 0 for v in (scale, smin, qmax, rng)):  # type: ignore
        return None  # a zero, negative or non-finite scale is not a range to compare with
    applied = d.get("applied", True)
    if not isinstance(applied, bool):
        return None
    lo, hi, zp = d.get("lo"), d.get("hi"), d.get("zero_point")
    if lo is not None or hi is not None:
        lo, hi = _num(lo), _num(hi)
        if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)) or not (
                lo <= 0.0 <= hi):
            return None
    if zp is not None and (isinstance(zp, bool) or not isinstance(zp, int)
                           or not -(2 ** 31) <= zp < 2 ** 31):
        return None
    fmt = canonical_format(fmt) or fmt[:40]  # "fp8-e4m3fn" and the like read as "fp8-e4m3"
    return StaticInput(module, scale, smin, fmt, qmax, rng,  # type: ignore[arg-type]
                       applied, _text(d.get("kernel")), _text(d.get("why")), lo, hi, zp)


def _text(v: Any) -> str:
    return v[:200] if isinstance(v, str) else ""


def _quant(q: Any) -> dict[str, Any] | None:
    if not isinstance(q, dict):
        return None
    return canonical_quant({str(k)[:40]: v for k, v in list(q.items())[:32]
                            if isinstance(v, (int, float, bool)) or (isinstance(v, str) and len(v) <= 200)})


def module_layout(module_type: str, info: dict[str, Any]) -> str:
    """The layout of a module from its info JSON, named by the one detector: what capture
    recorded (`layout`, the detector run on the live layer), else the detector on what the
    trace holds (its tensors' dtypes and shapes, its class, the engine's statement); "" when
    unknown. Capture's `quant.format` is not used: traces written before it was the
    detector's name call every non-AutoAWQ ``qweight`` layer "gptq" (vLLM's AWQ layers too)."""
    if info.get("layout") in FORMATS and info.get("layout") != "dense":
        return str(info["layout"])
    params = info.get("params")
    params = {str(k)[:_MAX_NAME]: v for k, v in list(params.items())[:64]} if isinstance(params, dict) else {}
    engine = info.get("engine") if isinstance(info.get("engine"), dict) else {}
    q = info.get("quant") if isinstance(info.get("quant"), dict) else {}
    layout = engine.get("layout") if engine.get("layout") in FORMATS else None
    bits = q.get("bits") if isinstance(q.get("bits"), int) and not isinstance(q.get("bits"), bool) else None
    return detect(params, _name(module_type), engine_layout=layout, bits=bits if bits in (2, 4, 8) else None).name


def read_module_quant(trace: Trace) -> dict[str, dict[str, Any]]:
    """Only the `quant` of each module's info (validated as in `read_module_infos`), for
    callers that need nothing else: the parameter health is not parsed."""
    out: dict[str, dict[str, Any]] = {}
    cols = trace.module_columns
    for name, raw in zip(cols["name"], cols["info"]):
        if not raw:
            continue
        try:
            info = json.loads(raw)
        except (ValueError, TypeError, RecursionError):
            continue
        q = _quant(info.get("quant")) if isinstance(info, dict) else None
        if q is not None:
            out[_name(name)] = q
    return out


def read_module_infos(trace: Trace) -> ModuleInfos:
    """Parse and validate every module's info JSON once."""
    out = ModuleInfos()
    cols = trace.module_columns
    for name, mtype, kind, raw in zip(cols["name"], cols["type"], cols["kind"], cols["info"]):
        name = _name(name)
        try:
            info = json.loads(raw) if raw else {}
        except (ValueError, TypeError, RecursionError):
            out.invalid += 1
            continue
        if not isinstance(info, dict):
            out.invalid += 1
            continue
        health = info.get("health")
        if isinstance(health, dict):
            for pname, d in list(health.items())[:64]:
                h = _health(name, _name(pname), d)
                if h is None:
                    out.invalid += 1
                else:
                    out.health.append(h)
        if "static_input" in info:
            st = _static(name, info["static_input"])
            if st is None:
                out.invalid += 1
            else:
                out.static_inputs[name] = st
        q = _quant(info.get("quant"))
        if q is not None:
            out.quant[name] = q
        if (isinstance(info.get("params"), dict) and info["params"]) or \
                info.get("layout") in FORMATS:
            layout = module_layout(mtype, info)
            if layout:
                out.layouts[name] = layout
        emb = info.get("embedding") if kind == "root" else None
        if isinstance(emb, dict) and isinstance(emb.get("health"), dict) and emb.get("name"):
            ename = _name(emb["name"])
            for pname, d in list(emb["health"].items())[:4]:
                h = _health(ename, _name(pname), d)
                if h is None:
                    out.invalid += 1
                else:
                    out.health.append(h)
                    out.unhooked.add(ename)
        if kind == "root" and isinstance(info.get("tied"), list):
            for g in info["tied"][:64]:
                if isinstance(g, list) and all(isinstance(n, str) for n in g) and len(g) > 1:
                    out.tied.append([_name(n) for n in g[:16]])
    return out
