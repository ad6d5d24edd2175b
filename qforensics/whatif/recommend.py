"""The what-if recommendation: the scheme to ship under a quality target (``--target``).

A target is a floor on one quality figure: ``99%`` or ``ppl:99%`` (recovered perplexity,
ppl_ref / ppl on the fixed text, the default) or ``top1:95%`` (text top-1: how often the
scheme's top token equals the reference's over the fixed text; its many positions make it the
steadier top-1 figure). Each scheme is judged on its figures through the engine when it was
served (``--engine vllm``: against vLLM's own bfloat16 run), else on its HF figures.

The rule: among the schemes that meet the floor, the least ``memory_vs_bf16`` (a scheme without
a memory figure ranks after those with one), then the highest ``decode_speed_vs_bf16`` (the
same), then the highest quality figure, then the order given. When none meets it, the closest
(the highest figure) is named with what it lacks, and what it would need: the Linears whose
recorded inputs hold the largest outliers against their typical channel (the trace's
per-channel ranges, `qforensics.whatif.salient`), kept in bfloat16 through the quantization
library's ignore list, with their largest channels.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qforensics.errors import UsageError
from qforensics.schemas import WHATIF_METRICS

__all__ = ["METRICS", "Target", "judged_figures", "parse_target", "quality_of", "recommend",
           "recommendation_lines"]

METRICS = WHATIF_METRICS  # metric -> its words (the document's vocabulary: schemas.py)
_ALIASES = {"ppl": "recovered", "recovered": "recovered", "perplexity": "recovered",
            "top1": "top1", "top-1": "top1", "text-top1": "top1"}
KEEP_LAYERS = 3  # Linears to name when no scheme meets the target
KEEP_CHANNELS = 8  # channels to name per Linear


@dataclass(frozen=True)
class Target:
    metric: str  # a key of METRICS
    floor: float  # a fraction: 0.99

    @property
    def words(self) -> str:
        return f"{METRICS[self.metric]} >= {100 * self.floor:g}%"

    def to_json(self) -> dict[str, Any]:
        return {"metric": self.metric, "floor": self.floor, "words": self.words}


def parse_target(text: str | None) -> Target | None:
    """``"99%"``, ``"0.99"``, ``"ppl:99%"``, ``"top1:95%"`` -> `Target`; None passes through.
    UsageError when it is not one."""
    if text is None:
        return None
    m = re.match(r"^\s*(?:([a-z0-9-]+)\s*:)?\s*([0-9.]+)\s*(%?)\s*$", str(text), re.IGNORECASE)
    metric = _ALIASES.get((m.group(1) or "ppl").lower()) if m else None
    if m is None or metric is None:
        raise UsageError(f"--target {text!r}: expected a quality floor like 99% (recovered "
                         "perplexity) or top1:95% (text top-1)")
    try:
        val = float(m.group(2)) / (100.0 if m.group(3) else 1.0)
    except ValueError:
        raise UsageError(f"--target {text!r}: {m.group(2)!r} is not a number") from None
    if not 0.0 < val <= 1.0:
        raise UsageError(f"--target {text!r}: the floor must be above 0% and at most 100%")
    return Target(metric, val)


def judged_figures(scheme: Any) -> dict[str, Any]:
    """The quality figures a scheme is judged on: through vLLM where it was served, else HF
    ({"from", "recovered", "text_top1", "top1"}; NaN where there is none)."""
    v = scheme.vllm if isinstance(scheme.vllm, dict) else {}
    if "ppl" in v and not v.get("nonfinite"):
        src, get = "vLLM", v.get
    elif scheme.error is not None or scheme.nonfinite:
        src, get = "HF", lambda k: math.nan
    else:
        src, get = "HF", lambda k: getattr(scheme, k)
    return {"from": src, **{k: float(get(k)) for k in ("recovered", "text_top1", "top1")}}


def quality_of(scheme: Any, metric: str) -> tuple[float, str]:
    """(the scheme's figure for ``metric``, where it comes from: "vLLM" or "HF")."""
    f = judged_figures(scheme)
    return f["recovered" if metric == "recovered" else "text_top1"], f["from"]


def _rank(x: float | None, lower_better: bool) -> tuple[int, float]:
    if x is None or not math.isfinite(x):
        return (1, 0.0)  # unknown: after every known one
    return (0, x if lower_better else -x)


def recommend(result: Any, target: Target,
              evidence: Callable[[], tuple[dict[str, Any], str]] | None = None
              ) -> dict[str, Any]:
    """The recommendation for ``result`` (a `WhatIfResult`) under ``target`` (see the module
    docstring). ``evidence`` gives ({Linear: per-input-channel absmax}, where they come from),
    called only when no scheme meets the target."""
    cands = []
    for i, s in enumerate(result.schemes):
        value, source = quality_of(s, target.metric)
        if not math.isfinite(value):
            continue
        cands.append({"scheme": s.scheme, "value": value, "from": source,
                      "memory_vs_bf16": s.memory_vs_bf16,
                      "decode_speed_vs_bf16": s.decode_speed_vs_bf16,
                      "meets": value >= target.floor, "_order": i})
    meets = [c for c in cands if c["meets"]]
    chosen = min(meets, key=lambda c: (_rank(c["memory_vs_bf16"], True),
                                       _rank(c["decode_speed_vs_bf16"], False),
                                       -c["value"], c["_order"])) if meets else None
    closest = None if meets or not cands else max(cands, key=lambda c: (c["value"],
                                                                         -c["_order"]))
    for c in cands:
        del c["_order"]
    out: dict[str, Any] = {
        "target": target.to_json(),
        "rule": "among the schemes meeting the target: least memory_vs_bf16, then highest "
                "decode_speed_vs_bf16, then highest quality (unmeasured ranks last)",
        "scheme": chosen["scheme"] if chosen else None,
        "meets": [c["scheme"] for c in meets], "candidates": cands, "closest": None,
        "needs": None,
    }
    if closest is not None:
        out["closest"] = {"scheme": closest["scheme"], "value": closest["value"],
                          "from": closest["from"], "short_by": target.floor - closest["value"]}
        out["needs"] = _needs(evidence, closest["scheme"])
    out["text"] = recommendation_lines(out)  # what the report shows, as whatif says it
    return out


def _kept_by(label: str) -> tuple[str | None, tuple[str, ...]]:
    """(the ``ct:`` recipe text ``label`` stands for, the Linears it keeps); (None, ()) when
    ``label`` is no compressed-tensors scheme."""
    from qforensics.errors import UsageError
    from qforensics.whatif.library import parse_ct_recipe

    if not label.startswith("ct:"):
        return None, ()
    try:
        recipe = parse_ct_recipe(label[3:])
    except UsageError:
        return None, ()
    if recipe is None:  # one preset on every decoder Linear: the recipe "layers=PRESET"
        return f"layers={label[3:]}", ()
    return recipe.text, recipe.keep


def _needs(evidence: Callable[[], tuple[dict[str, Any], str]] | None,
           closest: str = "") -> dict[str, Any]:
    """The salient Linears the closest scheme would need in bf16 (those it keeps already
    left out) and, for a ``ct:`` scheme, the recipe that keeps them (``try``, not measured)."""
    from qforensics.whatif.salient import outlier_layers

    found, source = evidence() if evidence is not None else ({}, "")
    text, kept = _kept_by(closest)
    found = {k: v for k, v in found.items() if k not in kept}
    layers = outlier_layers(found, KEEP_LAYERS, KEEP_CHANNELS) if found else []
    if not layers:
        return {"keep_bf16": [], "evidence": "no per-channel input ranges: nothing to name",
                "how": None, "try": None}
    return {"keep_bf16": layers, "evidence": source or "recorded per-channel input ranges",
            "how": "keep these Linears unquantized (the quantization library's ignore list: "
                   "compressed-tensors / llmcompressor `ignore`, AWQ `modules_to_not_convert`), "
                   "or their largest input channels in bf16 (--keep-salient); not measured here",
            "try": None if text is None else "ct:" + ",".join(
                [text] + [f"keep={x['module']}" for x in layers])}


def recommendation_lines(rec: dict[str, Any] | None) -> list[str]:
    """The recommendation as the text table's closing lines."""
    if rec is None:
        return []
    t = rec["target"]
    words = f"target {t['words']}"
    if rec["scheme"] is not None:
        c = next(c for c in rec["candidates"] if c["scheme"] == rec["scheme"])
        mem, fast = c["memory_vs_bf16"], c["decode_speed_vs_bf16"]
        return [f"recommendation ({words}): {rec['scheme']}: {100 * c['value']:.1f}% "
                f"({c['from']})" + (f", weights {100 * mem:.1f}% of bf16" if mem is not None
                                    else ", no memory figure") +
                (f", decode {fast:.2f}x bf16" if fast is not None and math.isfinite(fast)
                 else "") + f"; meets it: {', '.join(rec['meets'])}"]
    cl = rec["closest"]
    if cl is None:
        return [f"recommendation ({words}): none: no scheme was measured"]
    out = [f"recommendation ({words}): no scheme meets it; closest: {cl['scheme']} at "
           f"{100 * cl['value']:.1f}% ({cl['from']}), {100 * cl['short_by']:.1f} points short"]
    need = rec["needs"] or {}
    for layer in need.get("keep_bf16", []):
        out.append(f"  would need: {layer['module']} in bf16 (input absmax "
                   f"{layer['absmax']:.4g}, {layer['times_median']:.1f}x its median channel; "
                   f"channels {', '.join(str(c) for c in layer['channels'])})")
    if need.get("how"):
        out.append(f"  how: {need['how']} (evidence: {need['evidence']})")
    if need.get("try"):
        out.append(f"  to measure it: --scheme {need['try']}")
    return out
