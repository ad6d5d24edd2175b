"""The report's tables and texts from the analysis: parameter health (`Findings.parameters`,
in words), the generated text (meta outcome) and the environment, and number formatting. What
the figures show is analysis too (qforensics.analyze.views); nothing here reads a trace.

Every value here comes from an untrusted file: metadata is type-checked, strings are capped, and
nothing is marked safe for HTML (the template escapes). No torch import.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from qforensics.analyze.evidence import param_flag
from qforensics.analyze.findings import Findings
from qforensics.analyze.thresholds import Thresholds

__all__ = [
    "Health",
    "HealthRow",
    "Outcome",
    "environment_rows",
    "fmt_num",
    "health_from_findings",
    "read_outcome",
    "text_value",
]

MAX_TEXT = 20000
MAX_FIELD = 400


def fmt_num(v: Any, digits: int = 3) -> str:
    """A number for people: thousands separators for big values, a few significant digits."""
    if v is None:
        return "-"
    try:
        x = float(v)
    except (TypeError, ValueError):
        return text_value(v, 40)
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Inf" if x > 0 else "-Inf"
    if float(x).is_integer() and abs(x) < 1e15:
        return f"{int(x):,}"
    a = abs(x)
    if a >= 100:
        return f"{x:,.0f}"
    if a >= 10:
        return f"{x:,.1f}"
    if a >= 0.01:
        return f"{x:.{digits}g}"
    return f"{x:.2e}"


def text_value(v: Any, limit: int = MAX_FIELD) -> str:
    """Any metadata value as bounded display text (JSON for containers)."""
    if isinstance(v, str):
        s = v
    else:
        try:
            s = json.dumps(v, default=str, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError):
            s = repr(v)
    return s if len(s) <= limit else s[: limit - 3] + "..."


# -- parameter health ------------------------------------------------------------------------------
@dataclass(frozen=True)
class HealthRow:
    module: str
    param: str
    numel: int
    nan: int
    inf: int
    zero: int
    subnormal: int
    problem: str  # why the row is listed

    @property
    def zero_fraction(self) -> float:
        return self.zero / self.numel if self.numel else 0.0


@dataclass
class Health:
    modules: int = 0
    params_checked: int = 0
    with_nonfinite: int = 0
    mostly_zero: int = 0
    unreadable: int = 0
    rows: list[HealthRow] = field(default_factory=list)  # flagged rows, worst first
    rows_total: int = 0  # flagged rows before the cap


def _problem(h: Any, flag: str | None) -> str:
    """Words for the analysis's reason to list a parameter (`analyze.evidence.param_flag`)."""
    if flag == "nonfinite":
        where = f" from {h.first_nonfinite.words()}" if h.first_nonfinite else ""
        return ("NaN/Inf scales" if h.is_scale else "NaN/Inf values") + where
    if flag == "zero_scales":
        return "zero scales (every value in their group dequantizes to 0)"
    if flag == "zero_points":
        return f"{h.zero_point_out_of_range} zero points out of range"
    if flag == "mostly_zero":
        return f"{h.zero_share:.1%} exact zeros"
    if flag == "few_levels":
        return (f"{h.levels.levels_median:g} distinct values per group of "
                f"{h.levels.group_size} (median)")
    if flag == "dominated":
        return f"{h.levels.dominated_share:.0%} of groups scaled by one weight"
    return "not checked: " + text_value(h.error or "", 160)


def health_from_findings(findings: Findings, limit: int = 25) -> Health:
    """The Module health table from the analysis (`Findings.parameters`, worst first)."""
    summ = findings.parameter_summary or {}
    h = Health(modules=findings.n_modules, params_checked=int(summ.get("checked", 0)),
               with_nonfinite=int(summ.get("nonfinite", 0)),
               mostly_zero=int(summ.get("mostly_zero", 0)),
               unreadable=int(summ.get("unreadable", 0)))
    th = Thresholds.recorded(findings.thresholds)
    rows = [HealthRow(p.module, p.param, p.numel, p.nan, p.inf, p.zero, p.subnormal,
                      _problem(p, param_flag(p, th))) for p in findings.parameters]
    h.rows_total = len(rows)
    h.rows = rows[:limit]
    return h


# -- outcome (generated text) ----------------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    text: str | None
    reference_text: str | None
    prompt: str | None
    top1_agreement: float | None
    n_generated: int | None
    weights: str | None  # scheme names a scenario recorded (demo metadata)
    activations: str | None
    description: str | None


def _str(d: dict[str, Any], key: str, limit: int = MAX_TEXT) -> str | None:
    v = d.get(key)
    if not isinstance(v, str):
        return None
    return v if len(v) <= limit else v[:limit] + " [...]"


def read_outcome(meta: dict[str, Any]) -> Outcome:
    out = meta.get("outcome")
    env = meta.get("environment") if isinstance(meta.get("environment"), dict) else {}
    if not isinstance(out, dict):
        out = {}
    agree = out.get("top1_agreement")
    if isinstance(agree, bool) or not isinstance(agree, (int, float)) or not math.isfinite(agree):
        agree = None
    ids = out.get("generated_ids")
    return Outcome(
        text=_str(out, "text"),
        reference_text=_str(out, "reference_text"),
        prompt=_str(out, "prompt") or _str(env, "prompt"),
        top1_agreement=float(agree) if agree is not None else None,
        n_generated=len(ids) if isinstance(ids, list) else None,
        weights=_str(out, "weights", 80),
        activations=_str(out, "activations", 80),
        description=_str(out, "description", 600),
    )


# -- environment -----------------------------------------------------------------------------------
ENV_ORDER = ("qforensics", "torch", "transformers", "python", "platform", "host", "devices",
             "cuda", "dtypes", "fp8_cast", "model_class", "compiled", "rank", "world_size",
             "scenario", "prompt", "argv", "pid")


def _fp8_cast_text(v: Any) -> str:
    if not isinstance(v, dict):
        return text_value(v)
    parts = []
    for fmt, probe in (("e4m3fn", "e4m3fn_probe_value"), ("e5m2", "e5m2_probe_value")):
        if fmt in v:
            s = f"{fmt}: {text_value(v[fmt], 60)}"
            if probe in v:
                s += f" (probe {text_value(v[probe], 30)})"
            parts.append(s)
    rest = {k: x for k, x in v.items()
            if k not in ("e4m3fn", "e5m2", "e4m3fn_probe_value", "e5m2_probe_value")}
    if rest:
        parts.append(text_value(rest, 200))
    return "; ".join(parts) or "-"


def environment_rows(meta: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, value) rows: versions, device, FP8 cast behaviour, then everything else."""
    env = meta.get("environment")
    if not isinstance(env, dict):
        return []
    keys = [k for k in ENV_ORDER if k in env] + sorted(str(k) for k in env if k not in ENV_ORDER)
    rows = []
    for k in keys[:80]:
        v = env.get(k)
        if k == "fp8_cast":
            rows.append(("FP8 cast behaviour", _fp8_cast_text(v)))
        elif k == "cuda" and isinstance(v, dict):
            rows.append(("cuda", ("available" if v.get("available") else "not available")
                         + (f", version {text_value(v.get('version'), 40)}"
                            if v.get("version") else "")))
        elif k == "argv" and isinstance(v, list):
            rows.append(("command", " ".join(text_value(a, 200) for a in v[:40])))
        elif isinstance(v, list) and all(isinstance(x, (str, int, float)) for x in v):
            rows.append((str(k)[:80], ", ".join(text_value(x, 80) for x in v[:20])))
        else:
            rows.append((str(k)[:80], text_value(v)))
    return rows
