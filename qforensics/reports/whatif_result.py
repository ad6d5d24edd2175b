"""Read and validate a what-if result JSON (`qforensics whatif --json`, schema
`qforensics.whatif`) for the report's Recommendations section.

The file is untrusted input, like a trace: the schema name and major version are checked, every
field shown is type-checked, strings are length-capped, and nothing else is used. The figures
and the recommendation's words are what whatif wrote (qforensics.whatif decides; the report
presents). No torch import.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from qforensics.errors import UsageError
from qforensics.jsondoc import read_float, schema_problem
from qforensics.trace import validate

__all__ = ["WHATIF_SCHEMA", "WhatIfRow", "WhatIfSummary", "load_whatif_result",
           "parse_whatif_result"]

WHATIF_SCHEMA = "qforensics.whatif"  # its version: qforensics.jsondoc.SCHEMAS
MAX_BYTES = 16 << 20
MAX_SCHEMES = 64
MAX_STR = 300
RISK_LEVELS = ("high", "elevated", "low", "none", "unknown")  # qforensics.whatif.risk.LEVELS


@dataclass(frozen=True)
class WhatIfRow:
    """One scheme's row: the figures it was judged on and its memory, as text."""

    scheme: str
    source: str  # "vLLM" or "HF"
    recovered: str
    text_top1: str
    top1: str
    weights: str  # % of bf16, "-" without a checkpoint format
    engine: str  # vLLM engine RSS, % of bf16
    speed: str  # decode tokens/s through vLLM as a ratio to bf16 ("1.52x")
    prefill: str  # prefill tokens/s, the same
    risk: str = "-"  # what the trace predicts for it (qforensics.whatif.risk): its level
    chosen: bool = False
    error: str | None = None


@dataclass(frozen=True)
class WhatIfSummary:
    source: str
    target: str | None  # the target's words, None without --target
    recommended: str | None
    lines: list[str] = field(default_factory=list)  # whatif's recommendation, as it said it
    rows: list[WhatIfRow] = field(default_factory=list)


def _cap(v: Any) -> str:
    s = str(v)
    return s if len(s) <= MAX_STR else s[:MAX_STR] + "..."


def _pct(v: Any) -> str:
    x = read_float(v)  # a number, or "nan" / "inf" as the encoder writes them
    return "-" if x is None or not math.isfinite(x) else f"{100 * x:.1f}%"


def _times(v: Any) -> str:
    x = read_float(v)
    return "-" if x is None or not math.isfinite(x) else f"{x:.2f}x"


def _row(raw: Any, where: str, chosen: str | None) -> WhatIfRow:
    if not isinstance(raw, dict) or not isinstance(raw.get("scheme"), str):
        raise UsageError(f"{where}: each scheme must be an object with a 'scheme' string")
    judged = raw.get("judged") if isinstance(raw.get("judged"), dict) else {}
    err = raw.get("error")
    return WhatIfRow(
        scheme=_cap(raw["scheme"]), source=_cap(judged.get("from", "HF")),
        recovered=_pct(judged.get("recovered", raw.get("recovered"))),
        text_top1=_pct(judged.get("text_top1", raw.get("text_top1"))),
        top1=_pct(judged.get("top1", raw.get("top1"))),
        weights=_pct(raw.get("memory_vs_bf16")), engine=_pct(raw.get("engine_memory_vs_bf16")),
        speed=_times(raw.get("decode_speed_vs_bf16")),
        prefill=_times(raw.get("prefill_speed_vs_bf16")), risk=_risk(raw.get("risk")),
        chosen=raw["scheme"] == chosen,
        error=_cap(err) if isinstance(err, str) else None)


def _risk(v: Any) -> str:
    level = v.get("level") if isinstance(v, dict) else None
    return level if level in RISK_LEVELS else "-"


def parse_whatif_result(doc: Any, source: str = "<whatif result>") -> WhatIfSummary:
    """Validate a decoded what-if result. Raises UsageError saying what is wrong."""
    problem = schema_problem(doc, WHATIF_SCHEMA)
    if problem is not None:
        raise UsageError(f"{source}: not a what-if result this qforensics reads ({problem}); "
                         "write one with `qforensics whatif TRACE --scheme S --target 99% "
                         "--json whatif.json`")
    schemes = doc.get("schemes")
    if not isinstance(schemes, list) or len(schemes) > MAX_SCHEMES:
        raise UsageError(f"{source}: 'schemes' must be a list of at most {MAX_SCHEMES}")
    rec = doc.get("recommendation")
    if rec is not None and not isinstance(rec, dict):
        raise UsageError(f"{source}: 'recommendation' must be an object or null")
    rec = rec or {}
    chosen = rec.get("scheme") if isinstance(rec.get("scheme"), str) else None
    target = rec.get("target") if isinstance(rec.get("target"), dict) else {}
    words = target.get("words") if isinstance(target.get("words"), str) else None
    text = rec.get("text") if isinstance(rec.get("text"), list) else []
    return WhatIfSummary(
        source=_cap(source), target=_cap(words) if words else None,
        recommended=_cap(chosen) if chosen else None,
        lines=[_cap(t) for t in text[:20] if isinstance(t, str)],
        rows=[_row(r, f"{source}: schemes[{i}]", chosen) for i, r in enumerate(schemes)])


def load_whatif_result(path: str | os.PathLike[str]) -> WhatIfSummary:
    """Read and validate a file written by `qforensics whatif --json`."""
    p = os.fspath(path)
    validate.check_regular_file(p, "what-if result", UsageError)  # a FIFO would block the read
    try:
        with open(p, "rb") as fh:
            raw = fh.read(MAX_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"{p}: cannot read the what-if result ({exc.strerror or exc})") from exc
    if len(raw) > MAX_BYTES:
        raise UsageError(f"{p}: what-if result larger than {MAX_BYTES >> 20} MiB")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise UsageError(f"{p}: the what-if result is not valid JSON ({exc})") from exc
    return parse_whatif_result(doc, p)
