"""What the incident report shows beyond the findings, computed here so that qforensics.reports
only presents: the logits series per step, the module-by-step grid (analyze.grid), the
per-channel input range of the responsible module with the limits drawn over it, and the
divergence from a reference per module. `open_report_view` opens a trace, analyzes it (unless
findings are given) and returns both. Pure numpy over the reader; no torch import.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from qforensics.analyze.damage import per_tensor_zeroed
from qforensics.analyze.engine import warmup_steps
from qforensics.analyze.findings import DiffFindings, Findings, FirstNonfinite
from qforensics.analyze.grid import Heatmap, heatmap_of
from qforensics.analyze.nonfinite import find_first_bad_step
from qforensics.analyze.outliers import channel_absmax, standing_out
from qforensics.analyze.quantization import ModuleQuant, read_quant
from qforensics.analyze.thresholds import Thresholds
from qforensics.errors import TraceFormatError
from qforensics.formats import FORMAT_LIMITS
from qforensics.trace import schema
from qforensics.trace.reader import Trace, open_trace

__all__ = [
    "ChannelView",
    "DivergenceSeries",
    "LogitsSeries",
    "ReportView",
    "channel_view",
    "divergence_series",
    "format_limit",
    "logits_series",
    "open_report_view",
    "report_view",
]

LABELLED_FALLBACK = 3  # channels labelled when the findings name none of the module's


def format_limit(fmt: str | None) -> tuple[str, float]:
    """(display name, largest finite value) of the format a scheme name refers to (FP8 e4m3
    unless the name says e5m2 or FP16)."""
    f = (fmt or "").lower()
    if "e5m2" in f:
        return "FP8 e5m2", FORMAT_LIMITS["fp8-e5m2"]
    if f.startswith("fp16") or f == "float16":
        return "FP16", FORMAT_LIMITS["fp16"]
    return "FP8 e4m3", FORMAT_LIMITS["fp8-e4m3"]


# -- logits per step -------------------------------------------------------------------------------
@dataclass(frozen=True)
class LogitsSeries:
    """The logits summary of each step that recorded logits (warm-ups included, as recorded)."""

    steps: np.ndarray  # int64
    lmin: np.ndarray  # float64
    lmax: np.ndarray
    lmean: np.ndarray
    nonfinite: np.ndarray  # bool: the step's logits held NaN/Inf
    first_bad_step: int | None  # first bad step of the trace (trace.badstep; warm-ups left out)


def logits_series(trace: Trace, first: FirstNonfinite | None) -> LogitsSeries | None:
    steps = trace.step_table
    if steps.empty or not (steps["has_logits"] > 0).any():
        return None
    st = steps.take(steps["has_logits"] > 0)
    nonfinite = (st["logits_nan"] > 0) | (st["logits_inf"] > 0)
    first_bad = first.step if first is not None else None
    if first_bad is None:
        row = find_first_bad_step(steps, warmup=warmup_steps(trace))
        if row is not None:
            first_bad = int(steps["step"][row])
    f64 = np.float64
    return LogitsSeries(st["step"].astype(np.int64), st["logits_min"].astype(f64),
                        st["logits_max"].astype(f64), st["logits_mean"].astype(f64),
                        np.asarray(nonfinite, bool), first_bad)


# -- per-channel view of the responsible module ----------------------------------------------------
@dataclass(frozen=True)
class ChannelView:
    """Per-channel absmax of one module's input, the channels that stand out, the format's
    overflow limit and half the per-tensor INT4 scale (below it a channel rounds to 0)."""

    module: str
    step: int
    call_index: int  # -1 when unknown
    why: str  # "producer" | "outlier"
    absmax: np.ndarray  # float64, non-finite channels as 0 (outliers.channel_absmax)
    labelled: list[tuple[int, float]]  # (channel, absmax), largest first
    limit: tuple[str, float]  # (format name, largest finite value)
    int4_half_scale: float | None
    int4_zeroed: int  # channels below it


def _row_for(trace: Trace, step: int, call_index: int | None, module: str) -> int | None:
    recs = trace.record_table(step)
    sel = (recs["io"] == schema.IO_INPUT) & (recs["slot"] == 0)
    by_module = sel & (recs["module"] == module)
    hit = (sel & (recs["call_index"] == call_index) if call_index is not None and call_index >= 0
           else by_module)
    if not hit.any():
        hit = by_module
    if not hit.any():
        return None
    return int(recs["row"][np.argmax(hit)])


def _target(findings: Findings) -> tuple[str, int, int | None, str] | None:
    fn = findings.first_nonfinite
    if fn is not None and fn.producer_module is not None:
        return fn.producer_module, fn.step, fn.call_index, "producer"
    if findings.outliers:
        o = max(findings.outliers, key=lambda o: (o.absmax if math.isfinite(o.absmax) else -1))
        return o.module, o.step, o.call_index, "outlier"
    return None


def channel_view(trace: Trace, findings: Findings,
                 quant: dict[str, ModuleQuant]) -> ChannelView | None:
    """The producer's input channels (else those of the module of the largest outlier)."""
    target = _target(findings)
    if target is None:
        return None
    module, step, call, why = target
    try:
        row = _row_for(trace, step, call, module)
        rng = trace.channel_ranges(row) if row is not None else None
    except TraceFormatError:
        return None
    if rng is None:
        return None
    absmax = channel_absmax(*rng)
    mine = [o for o in findings.outliers if o.module == module and o.step == step
            and o.io == schema.IO_INPUT]
    labelled = [(int(o.channel), float(o.absmax)) for o in
                sorted(mine, key=lambda o: -o.absmax if math.isfinite(o.absmax) else 0)]
    if not labelled:
        hot = standing_out(absmax, Thresholds.recorded(findings.thresholds))[:LABELLED_FALLBACK]
        labelled = [(int(i), float(absmax[i])) for i in hot]
    half, zeroed = None, 0
    if absmax.size and absmax.max() > 0:
        scale, z = per_tensor_zeroed(absmax[None, :], 4)
        half, zeroed = float(scale[0]) / 2, int(z[0])
    q = quant.get(module)
    return ChannelView(module, step, int(call) if call is not None else -1, why, absmax,
                       labelled, format_limit(q.format if q else None), half, zeroed)


# -- divergence per module -------------------------------------------------------------------------
@dataclass(frozen=True)
class DivergenceSeries:
    """Largest divergence score of each module (call order) over its aligned records."""

    modules: list[str]
    scores: np.ndarray  # float64, +inf for a non-finite score
    nonfinite: np.ndarray  # bool: NaN/Inf only in the suspect trace
    first_jump: int | None  # index into `modules`
    step: int | None  # the one step compared, when only one was


def divergence_series(diff: DiffFindings) -> DivergenceSeries | None:
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
    if not mods:
        return None
    jump = None
    if diff.first_jump is not None and diff.first_jump.module in per:
        jump = mods.index(diff.first_jump.module)
    steps = sorted({per[m]["step"] for m in mods})
    return DivergenceSeries(mods, np.array([per[m]["score"] for m in mods], np.float64),
                            np.array([per[m]["nonfinite"] for m in mods], dtype=bool), jump,
                            steps[0] if len(steps) == 1 else None)


# -- everything the report shows -------------------------------------------------------------------
@dataclass(frozen=True)
class ReportView:
    meta: dict[str, Any]  # the trace's metadata as the reader parsed it (untrusted strings)
    quant: dict[str, ModuleQuant]
    logits: LogitsSeries | None
    heatmap: Heatmap | None
    channels: ChannelView | None
    divergence: DivergenceSeries | None


def report_view(trace: Trace, findings: Findings,
                diff: DiffFindings | None = None) -> ReportView:
    quant = read_quant(trace)
    fn = findings.first_nonfinite
    return ReportView(trace.meta, quant, logits_series(trace, fn), heatmap_of(trace, fn),
                      channel_view(trace, findings, quant),
                      divergence_series(diff) if diff is not None else None)


def open_report_view(path: str | os.PathLike[str], *,
                     reference: str | os.PathLike[str] | None = None,
                     findings: Findings | None = None, diff: DiffFindings | None = None
                     ) -> tuple[Findings, DiffFindings | None, ReportView]:
    """Open `path`, diff it against `reference` and analyze it (each unless given), and read
    the report's view. Raises TraceFormatError for an unreadable trace or reference."""
    from qforensics.analyze.analyzer import analyze_open_trace
    from qforensics.analyze.diff import diff_traces

    p = os.fspath(path)
    ref = os.fspath(reference) if reference is not None else None
    with open_trace(p) as trace:
        if ref is not None and diff is None:
            with open_trace(ref):
                pass  # validate first: a bad reference is a user error, said clearly
            diff = diff_traces(ref, p, top=100_000)  # every aligned record: the plot shows all
        if findings is None:
            t0 = time.perf_counter()
            findings = analyze_open_trace(trace, reference=ref, reference_diff=diff)
            findings.seconds = round(time.perf_counter() - t0, 4)
        return findings, diff, report_view(trace, findings, diff)
