"""Findings -> one self-contained HTML incident report.

`write_report(trace, out)` has the analysis analyze the trace (or takes findings you pass) and
read what the findings do not carry (`analyze.views`: logits per step, the module-by-step
absmax grid, the responsible module's per-channel range, the metadata), renders the figures
with matplotlib as PNG data URIs and fills `templates/report.html.j2` with Jinja2 autoescaping
on. Nothing here reads the trace or decides what stands out.

The page loads nothing: no network, no external scripts, styles or fonts. A Content-Security-
Policy meta tag allows only inline styles, data: images and the one inline script of this
module (by its SHA-256 hash). Trace content is never marked safe. No torch import; never prints.
"""

from __future__ import annotations

import base64
import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup

from qforensics.analyze.findings import (
    FAILED,
    PASSED,
    SUSPECT,
    DiffFindings,
    Findings,
    Verdict,
)
from qforensics.analyze.quantization import ModuleQuant
from qforensics.analyze.views import ReportView, open_report_view
from qforensics.atomic import write_text
from qforensics.errors import QForensicsError
from qforensics.reports import facts, narrative, plots, recommendations
from qforensics.reports.replay_result import ReplaySummary, load_replay_result
from qforensics.reports.whatif_result import WhatIfSummary, load_whatif_result
from qforensics.version import __version__

__all__ = ["CSP_SCRIPT", "ReportResult", "content_security_policy", "render_report", "write_report"]

TEMPLATE = "report.html.j2"

# The report's only script: buttons to open/close every section (the page works without it).
CSP_SCRIPT = (
    "(function(){"
    "var b=document.getElementById('qf-toggles');if(!b){return;}b.hidden=false;"
    "function set(o){var d=document.querySelectorAll('details.qf-section');"
    "for(var i=0;i<d.length;i++){d[i].open=o;}}"
    "document.getElementById('qf-open-all').addEventListener('click',function(){set(true);});"
    "document.getElementById('qf-close-all').addEventListener('click',function(){set(false);});"
    "})();"
)


def content_security_policy(script: str = CSP_SCRIPT) -> str:
    digest = base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode("ascii")
    return ("default-src 'none'; img-src data:; style-src 'unsafe-inline'; "
            f"script-src 'sha256-{digest}'; base-uri 'none'; form-action 'none'")


@dataclass(frozen=True)
class ReportResult:
    path: Path
    verdict: Verdict
    bytes: int
    seconds: float


def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("qforensics.reports", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["num"] = facts.fmt_num
    env.filters["pct"] = lambda v: "-" if v is None else f"{float(v):.1%}"
    return env


def _strip_status(line: str, status: str) -> str:
    """'FAILED | first ...' -> 'first ...' (the banner shows the status in large type)."""
    head, sep, rest = line.partition(" | ")
    return rest if sep and head.strip() == status else line


def _status_class(status: str) -> str:
    return {FAILED: "failed", SUSPECT: "suspect", PASSED: "passed"}.get(status, "suspect")


def _divergence_view(diff: DiffFindings | None, view: ReportView) -> dict[str, Any] | None:
    if diff is None:
        return None
    return {"diff": diff, "figure": plots.plot_divergence(view.divergence),
            "rows": list(diff.ranked[:20])}


def build_context(view: ReportView, findings: Findings, *, trace_arg: str,
                  diff: DiffFindings | None = None, replay: ReplaySummary | None = None,
                  reference_arg: str | None = None,
                  whatif: WhatIfSummary | None = None) -> dict[str, Any]:
    """Everything the template shows, as plain values (strings unescaped: Jinja escapes), from
    the findings and the analysis's view of the trace (`analyze.views.report_view`)."""
    meta = view.meta
    env = meta.get("environment") if isinstance(meta.get("environment"), dict) else {}
    quant = view.quant
    health = facts.health_from_findings(findings)
    outcome = facts.read_outcome(meta)
    div = _divergence_view(diff, view)
    figures = [f for f in (plots.plot_logits(view.logits), plots.plot_heatmap(view.heatmap),
                           plots.plot_channels(view.channels)) if f is not None]
    if div is not None and div["figure"] is not None:
        figures.append(div["figure"])
    chain = narrative.causal_chain(findings, quant, health, outcome, env, diff)
    recs = recommendations.recommendations(findings, quant, health, outcome, env,
                                           trace_arg=trace_arg, reference_arg=reference_arg,
                                           replay=replay)
    fn = findings.first_nonfinite
    producer_damage = []
    if fn is not None or findings.outliers:
        focus = fn.module if fn is not None else findings.outliers[0].module
        producer_damage = [d for d in findings.damage if d.module == focus]
    else:
        focus = None
    capture = meta.get("capture_options") if isinstance(meta.get("capture_options"), dict) else {}
    scenario = env.get("scenario") if isinstance(env.get("scenario"), str) else None
    eng = getattr(findings, "engine", None)  # analyze.engine.EngineFindings (vLLM)
    return {
        "title": f"qforensics incident report: {os.path.basename(trace_arg)}",
        "csp": content_security_policy(),
        "script": Markup(CSP_SCRIPT),  # our own constant, never trace content
        "status": findings.verdict.status,
        "status_class": _status_class(findings.verdict.status),
        "verdict_line": findings.verdict.line,
        "verdict_text": _strip_status(findings.verdict.line, findings.verdict.status),
        "trace_name": os.path.basename(trace_arg),
        "trace_arg": trace_arg,
        "reference_arg": reference_arg,
        "scenario": scenario[:120] if scenario else None,
        "findings": findings,
        "first": fn,
        "chain": chain,
        "precursors": findings.precursors,
        "evidence": findings.evidence,
        "outcome": outcome,
        "figures": figures,
        "recommendations": recs,
        "replay": replay,
        "whatif": whatif,
        "outliers": findings.outliers,
        "persistent": findings.persistent,
        "unsafe": findings.unsafe,
        "focus": focus,
        "producer_damage": producer_damage,
        "environment": facts.environment_rows(meta),
        "capture": [(str(k)[:80], facts.text_value(v, 200)) for k, v in
                    list(capture.items())[:40]],
        "health": health,
        "quant_summary": _quant_summary(quant),
        "divergence": div,
        "notes": findings.notes,
        "bad_requests": eng.went_bad[:200] if eng is not None else [],
        "bad_requests_total": len(eng.went_bad) if eng is not None else 0,
        "same_spots": eng.same_spots if eng is not None else [],
        "unattributed_steps": eng.unattributed_steps if eng is not None else 0,
        "incidents": getattr(findings, "incidents", [])[:200],
        "incidents_total": len(getattr(findings, "incidents", [])),
        "snapshots": findings.snapshots,
        "end": findings.end,
        "generated": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "version": __version__,
    }


def _quant_summary(quant: dict[str, ModuleQuant]) -> list[tuple[str, str, int]]:
    counts: dict[tuple[str, str], int] = {}
    for q in quant.values():
        counts[(q.format, q.target)] = counts.get((q.format, q.target), 0) + 1
    return sorted(((f, t, n) for (f, t), n in counts.items()), key=lambda r: -r[2])


def render_report(trace_path: str | os.PathLike[str], *,
                  reference: str | os.PathLike[str] | None = None,
                  replay: str | os.PathLike[str] | ReplaySummary | None = None,
                  findings: Findings | None = None,
                  diff: DiffFindings | None = None,
                  whatif: str | os.PathLike[str] | WhatIfSummary | None = None
                  ) -> tuple[str, Findings]:
    """The report's HTML and the findings it shows.

    `findings` / `diff` skip the analysis when given (e.g. already computed, or built in a
    test). `replay` is a path to a `qforensics replay --json` result or a parsed summary.
    `whatif`: a `qforensics whatif --json` result (or its parsed summary), shown with the
    recommendations. Raises TraceFormatError for unreadable traces, UsageError for a bad
    replay or what-if result.
    """
    path = os.fspath(trace_path)
    ref = os.fspath(reference) if reference is not None else None
    replay_summary = (replay if isinstance(replay, ReplaySummary) or replay is None
                      else load_replay_result(replay))
    whatif_summary = (whatif if isinstance(whatif, WhatIfSummary) or whatif is None
                      else load_whatif_result(whatif))
    findings, diff, view = open_report_view(path, reference=ref, findings=findings, diff=diff)
    ctx = build_context(view, findings, trace_arg=path, diff=diff, replay=replay_summary,
                        reference_arg=ref, whatif=whatif_summary)
    html = _env().get_template(TEMPLATE).render(**ctx)
    return html, findings


def write_report(trace_path: str | os.PathLike[str], out_path: str | os.PathLike[str], *,
                 reference: str | os.PathLike[str] | None = None,
                 replay: str | os.PathLike[str] | ReplaySummary | None = None,
                 findings: Findings | None = None,
                 diff: DiffFindings | None = None,
                 whatif: str | os.PathLike[str] | WhatIfSummary | None = None) -> ReportResult:
    """Write the incident report for `trace_path` to `out_path` (HTML, self-contained)."""
    t0 = time.perf_counter()
    html, f = render_report(trace_path, reference=reference, replay=replay, findings=findings,
                            diff=diff, whatif=whatif)
    out = Path(out_path)
    try:
        if out.parent and not out.parent.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
        write_text(out, html)
    except OSError as exc:
        raise QForensicsError(f"{out}: cannot write the report ({exc.strerror or exc}); "
                              "choose another -o path") from exc
    return ReportResult(out, f.verdict, len(html.encode("utf-8")), time.perf_counter() - t0)
