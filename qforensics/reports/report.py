"""Findings -> one self-contained HTML incident report.

`write_report(trace, out)` analyzes the trace (or takes findings you pass), reads the few
things the findings do not carry (logits per step, the module-by-step absmax grid, the
responsible module's per-channel range, module health, environment, generated text), renders
the figures as PNG data URIs and fills `templates/report.html.j2` with Jinja2 autoescaping on.

The page loads nothing: no network, no external scripts, styles or fonts. A Content-Security-
Policy meta tag allows only inline styles, data: images and the one inline script of this
module (by its SHA-256 hash). Trace content is never marked safe. No torch import; never prints.
"""

from __future__ import annotations

import base64
import hashlib
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
from markupsafe import Markup

from qforensics.analyze.findings import (
    FAILED,
    PASSED,
    SUSPECT,
    DiffFindings,
    Findings,
    Verdict,
)
from qforensics.analyze.grid import bin_heatmap, read_grid
from qforensics.analyze.quantization import read_quant
from qforensics.errors import QForensicsError
from qforensics.reports import facts, narrative, plots, recommendations
from qforensics.reports.replay_result import ReplaySummary, load_replay_result
from qforensics.reports.whatif_result import WhatIfSummary, load_whatif_result
from qforensics.trace.reader import Trace, open_trace
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


def _logits_figure(trace: Trace, findings: Findings) -> plots.Figure | None:
    steps = trace.step_table
    if steps.empty or not (steps["has_logits"] > 0).any():
        return None
    st = steps.take(steps["has_logits"] > 0)
    nonfinite = (st["logits_nan"] > 0) | (st["logits_inf"] > 0)
    first_bad = findings.first_nonfinite.step if findings.first_nonfinite is not None else None
    if first_bad is None:
        bad_calls = steps["step"][steps["first_nonfinite_call"] >= 0]
        if len(bad_calls):
            first_bad = int(bad_calls[0])
        elif nonfinite.any():
            first_bad = int(st["step"][np.argmax(nonfinite)])
    return plots.plot_logits(st["step"], st["logits_min"].astype(np.float64),
                             st["logits_max"].astype(np.float64),
                             st["logits_mean"].astype(np.float64), nonfinite, first_bad)


def _heatmap_figure(trace: Trace, findings: Findings) -> plots.Figure | None:
    grid = read_grid(trace)
    if grid is None:
        return None
    hm = bin_heatmap(grid.values, grid.bad, grid.labels)
    mark = None
    fn = findings.first_nonfinite
    if fn is not None:
        names = grid.labels
        rows = [i for i, n in enumerate(names) if n == fn.module]
        cols = np.nonzero(grid.steps == fn.step)[0]
        if rows and len(cols):
            mark = (rows[0], int(cols[0]))
    return plots.plot_heatmap(hm, mark)


def _channels_figure(view: facts.ChannelView | None, quant: dict[str, facts.ModuleQuant]
                     ) -> plots.Figure | None:
    if view is None:
        return None
    q = quant.get(view.module)
    limit = narrative.format_limit(q.format if q else None)
    fin = view.absmax[np.isfinite(view.absmax)]
    half = float(fin.max()) / 7.0 / 2.0 if fin.size else None
    who = {"producer": "producer", "outlier": "largest outlier"}.get(view.why, view.why)
    title = (f"Input channels of {view.module} ({who}), step {view.step}"
             + (f", call {view.call_index}" if view.call_index >= 0 else ""))
    return plots.plot_channels(view.absmax, title, view.labelled, limit, half)


def _divergence_view(diff: DiffFindings | None) -> dict[str, Any] | None:
    if diff is None:
        return None
    per: dict[str, dict[str, Any]] = {}
    for d in diff.ranked:
        cur = per.get(d.module)
        score = d.score if math.isfinite(d.score) else float("inf")
        if cur is None:
            per[d.module] = {"call": d.call_index, "score": score, "nonfinite": d.nonfinite,
                             "step": d.step}
        else:
            cur["call"] = min(cur["call"], d.call_index)
            cur["score"] = max(cur["score"], score)
            cur["nonfinite"] = cur["nonfinite"] or d.nonfinite
    mods = sorted(per, key=lambda m: per[m]["call"])
    fig = None
    if mods:
        jump = None
        if diff.first_jump is not None and diff.first_jump.module in per:
            jump = mods.index(diff.first_jump.module)
        steps = sorted({per[m]["step"] for m in mods})
        fig = plots.plot_divergence(mods, np.array([per[m]["score"] for m in mods]),
                                    np.array([per[m]["nonfinite"] for m in mods], dtype=bool),
                                    jump, steps[0] if len(steps) == 1 else None)
    return {"diff": diff, "figure": fig, "rows": list(diff.ranked[:20])}


def build_context(trace: Trace, findings: Findings, *, trace_arg: str,
                  diff: DiffFindings | None = None, replay: ReplaySummary | None = None,
                  reference_arg: str | None = None,
                  whatif: WhatIfSummary | None = None) -> dict[str, Any]:
    """Everything the template shows, as plain values (strings unescaped: Jinja escapes)."""
    meta = trace.meta
    env = meta.get("environment") if isinstance(meta.get("environment"), dict) else {}
    quant = read_quant(trace)
    health = facts.health_from_findings(findings)
    outcome = facts.read_outcome(meta)
    view = facts.read_channels(trace, findings)
    div = _divergence_view(diff)
    figures = [f for f in (_logits_figure(trace, findings), _heatmap_figure(trace, findings),
                           _channels_figure(view, quant)) if f is not None]
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


def _quant_summary(quant: dict[str, facts.ModuleQuant]) -> list[tuple[str, str, int]]:
    counts: dict[tuple[str, str], int] = {}
    for q in quant.values():
        counts[(q.format, q.target)] = counts.get((q.format, q.target), 0) + 1
    return sorted(((f, t, n) for (f, t), n in counts.items()), key=lambda r: -r[2])


def _analyze(trace: Trace, ref: str | None, diff: DiffFindings | None) -> Findings:
    from qforensics.analyze.analyzer import analyze_open_trace

    t0 = time.perf_counter()
    f = analyze_open_trace(trace, reference=ref, reference_diff=diff)
    f.seconds = round(time.perf_counter() - t0, 4)
    return f


def _diff(reference: str, suspect: str) -> DiffFindings:
    from qforensics.analyze import diff_traces

    # every aligned record, not just the top ten: the plot shows each module
    return diff_traces(reference, suspect, top=100_000)


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
    with open_trace(path) as trace:
        if ref is not None and diff is None:
            with open_trace(ref):
                pass  # validate first: a bad reference is a user error, said clearly
            diff = _diff(ref, path)
        if findings is None:
            findings = _analyze(trace, ref, diff)
        ctx = build_context(trace, findings, trace_arg=path, diff=diff,
                            replay=replay_summary, reference_arg=ref, whatif=whatif_summary)
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
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(html, encoding="utf-8")
        os.replace(tmp, out)
    except OSError as exc:
        raise QForensicsError(f"{out}: cannot write the report ({exc.strerror or exc}); "
                              "choose another -o path") from exc
    return ReportResult(out, f.verdict, len(html.encode("utf-8")), time.perf_counter() - t0)
