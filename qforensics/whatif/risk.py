"""Risk: whether the trace's own evidence predicts trouble for a what-if scheme.

Two kinds of evidence, both read from the trace (no model run):

- activations (schemes that quantize a Linear's input: ``ct:W8A8``, ``llmc:SQ-W8A8``,
  ``ct:FP8_DYNAMIC``, ``act:...``): analyze's predicted damage (`qforensics.analyze.damage`:
  the recorded per-channel ranges and per-token absmax of its focus step) for the scheme's
  activation format, over the Linears the scheme quantizes: a Linear is unsafe when the format
  zeroes at least ``unsafe_fraction`` (50%) of its input channels or a channel overflows the
  format's range. compressed-tensors' per-token INT8 is analyze's ``int8-per-token``; its
  per-token FP8 has no per-token twin there, so ``fp8-e4m3-dynamic`` (one scale per tensor)
  stands in: it zeroes at least the channels a per-token scale would.
- weights (every scheme): salient input channels, the recorded per-channel input absmax over
  every stored step (`qforensics.whatif.salient`, the evidence --keep-salient uses): a Linear
  has them when its largest channel is at least ``ratio`` (20) x its median channel. A weight
  rounding error on such a channel is multiplied by it (the premise of AWQ and --keep-salient).

Level, worst first: ``high`` (the activation format is unsafe for at least one Linear it
quantizes), ``elevated`` (weights at 4 bits or fewer, salient channels in a Linear they
quantize, none kept in bf16), ``low`` (salient channels, but 8-bit weights or kept), ``none``
(evidence for every part of the scheme, nothing found), ``unknown`` (no evidence: no trace, no
channel ranges, or an activation format analyze does not predict). Linears a scheme leaves
alone (``lm_head``; those whose in_features its group size does not divide) are not counted.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from qforensics.schemas import WHATIF_RISK_LEVELS

__all__ = ["LEVELS", "SchemeFormat", "TraceEvidence", "attach_risk", "risk_lines",
           "scheme_format", "scheme_risk", "trace_evidence"]

LEVELS = WHATIF_RISK_LEVELS  # the document's vocabulary (schemas.py)
_SKIP = ("lm_head",)


@dataclass(frozen=True)
class SchemeFormat:
    """What a what-if scheme quantizes, in the terms the evidence is read in."""

    weight_bits: int | None  # None: weights stay as they are
    group: int | None = None  # weights and activations quantize Linears this divides
    activations: str | None = None  # analyze's damage scheme (e.g. "int8-per-token")
    activation_words: str | None = None  # the scheme's own words, when they differ
    keeps_salient: bool = False
    linears: Callable[[str], bool] | None = None  # the Linears it takes (None: every one)


@dataclass
class TraceEvidence:
    damage: dict[str, list[Any]] = field(default_factory=dict)  # scheme -> [SchemeDamage]
    damage_step: int | None = None
    absmax: dict[str, np.ndarray] = field(default_factory=dict)  # Linear -> input absmax [K]
    ratio: float = 20.0
    unsafe_fraction: float = 0.5
    source: str = ""


def trace_evidence(path: str | os.PathLike[str] | None) -> TraceEvidence | None:
    """analyze's damage prediction and the salient-channel ranges of the trace at ``path``
    (None without a trace)."""
    if path is None:
        return None
    from qforensics.analyze import analyze_trace
    from qforensics.analyze.thresholds import Thresholds
    from qforensics.whatif.salient import absmax_from_trace

    th = Thresholds()
    f = analyze_trace(path)
    ev = TraceEvidence(damage_step=f.damage_step, ratio=th.ratio,
                       unsafe_fraction=th.unsafe_fraction)
    for d in f.damage:
        ev.damage.setdefault(d.scheme, []).append(d)
    ta = absmax_from_trace(path)
    ev.absmax = dict(ta.absmax)
    step = f"damage predicted at step {f.damage_step}" if f.damage_step is not None else \
        "no damage prediction (no per-channel ranges at analyze's focus step)"
    ev.source = f"{os.path.basename(os.fspath(path))}: {step}; salient: {ta.describe()}"
    return ev


def _ct_format(preset: str, linears: Callable[[str], bool] | None = None) -> SchemeFormat:
    from qforensics.whatif.library import check_compressed_tensors_preset

    cs = check_compressed_tensors_preset(preset)
    w, a = cs.weights, cs.input_activations
    group = int(w.group_size) if _val(w.strategy) == "group" else None
    act = words = None
    if a is not None:
        words = f"{_val(a.type)}{a.num_bits} per {_val(a.strategy)}, dynamic"
        act = ("fp8-e4m3-dynamic" if _val(a.type) == "float" else
               f"int{a.num_bits}-per-token" if _val(a.strategy) == "token" else
               f"int{a.num_bits}-per-tensor")
    return SchemeFormat(int(w.num_bits), group, act, words, linears=linears)


def recipe_formats(sc: Any) -> dict[str, SchemeFormat] | None:
    """{part: `SchemeFormat` over the part's Linears, kept ones excluded} of a mixed
    ``ct:`` recipe; None for any other scheme."""
    if sc.library != "compressed-tensors":
        return None
    from qforensics.whatif.library import parse_ct_recipe

    recipe = parse_ct_recipe(sc.preset)
    if recipe is None:
        return None
    kept = set(recipe.keep)

    def taker(key: str) -> Callable[[str], bool]:
        return lambda name: name not in kept and recipe.part_of(name) == key

    return {key: _ct_format(preset, taker(key)) for key, preset in recipe.parts}


def scheme_format(sc: Any) -> SchemeFormat:
    """The `SchemeFormat` of a `WhatIfScheme` (of a mixed recipe: see `recipe_formats`)."""
    if sc.library in ("compressed-tensors", "llmcompressor"):
        return _ct_format(sc.preset)
    if sc.library == "awq":
        return SchemeFormat(4, sc.awq_group)
    w, a = sc.weights, sc.activations
    act = str(a).replace("-nosat", "") if a is not None else None
    return SchemeFormat(int(w.bits) if w is not None else None, None, act,
                        str(a) if a is not None and str(a) != act else None,
                        bool(w is not None and w.keep_salient))


def _val(x: Any) -> str:
    return str(getattr(x, "value", x))


def _quantized(name: str, width: int, fmt: SchemeFormat) -> bool:
    return name.rsplit(".", 1)[-1] not in _SKIP and (fmt.group is None or width % fmt.group == 0
                                                     ) and (fmt.linears is None or fmt.linears(name))


def _activation_part(fmt: SchemeFormat, ev: TraceEvidence) -> dict[str, Any] | None:
    rows = [d for d in ev.damage.get(str(fmt.activations), [])
            if _quantized(d.module, d.channels_total, fmt)]
    if not rows:
        return None
    bad = sorted((d for d in rows if d.unsafe),
                 key=lambda d: (-d.overflow_count, -d.fraction, d.module))
    out: dict[str, Any] = {"format": fmt.activations, "unsafe": len(bad), "linears": len(rows),
                           "step": ev.damage_step, "worst": None}
    if fmt.activation_words:
        out["scheme_format"] = fmt.activation_words
    if bad:
        w = bad[0]
        out["worst"] = {"module": w.module, "channels_zeroed": w.channels_zeroed,
                        "channels": w.channels_total, "overflow": w.overflow_count}
    return out


def _salient_part(fmt: SchemeFormat, ev: TraceEvidence) -> dict[str, Any] | None:
    found = []
    n = 0
    for name, a in ev.absmax.items():
        v = np.asarray(a, dtype=np.float64).reshape(-1)
        if not _quantized(name, len(v), fmt):
            continue
        v = v[np.isfinite(v)]
        if not len(v):
            continue
        n += 1
        med, top = float(np.median(v)), float(v.max())
        times = top / med if med > 0 else (math.inf if top > 0 else 0.0)
        if times >= ev.ratio:
            found.append((times, name, top))
    if not n:
        return None
    found.sort(key=lambda t: (-t[0], t[1]))
    return {"linears_with_salient": len(found), "linears": n, "ratio": ev.ratio,
            "weight_bits": fmt.weight_bits, "kept_bf16": fmt.keeps_salient,
            "largest": ({"module": found[0][1], "absmax": found[0][2],
                         "times_median": found[0][0]} if found else None)}


def scheme_risk(sc: Any, ev: TraceEvidence | None) -> dict[str, Any]:
    """The JSON's ``risk`` of one scheme (see the module docstring): ``level``,
    ``activations`` and ``salient`` (what was found, None: no evidence or not quantized),
    ``evidence`` and ``line`` (the words the table prints). A mixed recipe is rated per part
    (``parts``), over the part's Linears; its level is the worst part's, ``unknown`` only
    below the parts that found something."""
    if ev is None:
        return {"level": "unknown", "activations": None, "salient": None, "evidence": None,
                "line": "no trace given: no evidence"}
    parts = recipe_formats(sc)
    if parts is None:
        return _format_risk(scheme_format(sc), ev)
    rated = {key: _format_risk(fmt, ev) for key, fmt in parts.items()}
    order = ("high", "elevated", "low", "unknown", "none")
    worst = min(rated.values(), key=lambda r: order.index(r["level"]))
    return {"level": worst["level"], "activations": worst["activations"],
            "salient": worst["salient"], "evidence": ev.source,
            "line": "; ".join(f"{k}: {r['level']}: {r['line']}" for k, r in rated.items()),
            "parts": rated}


def _format_risk(fmt: SchemeFormat, ev: TraceEvidence) -> dict[str, Any]:
    act = _activation_part(fmt, ev) if fmt.activations else None
    sal = _salient_part(fmt, ev) if fmt.weight_bits is not None else None
    salient = sal is not None and sal["linears_with_salient"] > 0
    weak = (fmt.weight_bits or 16) <= 4 and not fmt.keeps_salient
    missing = (fmt.activations is not None and act is None) or \
        (fmt.weight_bits is not None and sal is None)
    level = ("high" if act is not None and act["unsafe"] else "elevated" if salient and weak
             else "low" if salient else "unknown" if missing else "none")
    why = []
    if act is not None and act["unsafe"]:
        w = act["worst"]
        what = (f"{w['overflow']:,} channels overflow" if w["overflow"] else
                f"{w['channels_zeroed']:,} of {w['channels']:,} input channels quantize to zero")
        why.append(f"{act['format']} activations unsafe for {act['unsafe']} of "
                   f"{act['linears']} Linears (worst {w['module']}: {what})")
    elif act is not None:
        why.append(f"{act['format']} activations: none of {act['linears']} Linears unsafe")
    if salient:
        big = sal["largest"]
        why.append(f"salient input channels in {sal['linears_with_salient']} of "
                   f"{sal['linears']} Linears, {fmt.weight_bits}-bit weights"
                   + (" (kept in bf16)" if fmt.keeps_salient else "") +
                   f" (largest: {big['module']}, {big['times_median']:.0f}x its median channel)")
    if missing:
        why.append("no evidence in the trace for its "
                   + ("activation format " + str(fmt.activations) if fmt.activations and
                      act is None else "weights (no per-channel input ranges)"))
    return {"level": level, "activations": act, "salient": sal, "evidence": ev.source,
            "line": "; ".join(why) if why else "nothing in the trace predicts trouble"}


def attach_risk(result: Any, parsed: list[Any], trace: str | os.PathLike[str] | None) -> None:
    """Each of ``result``'s schemes (in the order of ``parsed``) gets its `scheme_risk`."""
    from qforensics.errors import QForensicsError

    try:
        ev = trace_evidence(trace)
    except QForensicsError as exc:  # analyze cannot read it: no evidence, said per scheme
        ev = TraceEvidence(source=f"analyze could not read the trace: {exc}")
    for r, sc in zip(result.schemes, parsed):
        r.risk = scheme_risk(sc, ev)


def risk_lines(schemes: list[Any]) -> list[str]:
    """The table's note on the risk column, with each scheme's reason."""
    rated = [s for s in schemes if isinstance(s.risk, dict)]
    if not rated:
        return []
    ev = next((s.risk["evidence"] for s in rated if s.risk.get("evidence")), None)
    return [f"risk: what the trace predicts (activation damage by analyze, salient input "
            f"channels): high / elevated / low / none / unknown ({ev or 'no trace given'})",
            *(f"  {s.scheme}: {s.risk['level']}: {s.risk['line']}" for s in rated)]
