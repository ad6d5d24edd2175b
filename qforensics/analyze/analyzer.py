"""`analyze_trace(path) -> Findings`: the whole analysis of one trace, and `analyze_traces` for
one trace per rank.

Reads, in order: the /steps summaries (first bad step, logits), the records of ONE step (the
failing one, or the step whose linear inputs peaked when nothing failed), the per-channel ranges
and per-token absmax of that step (one span each), and a few narrow record columns for the
spread and the outlier trends. The verdict line is analyze/verdict.py's `verdict_for`
(re-exported here). Never imports torch; never prints.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from qforensics.analyze.cause import classify_cause, describe_nonfinite_logits
from qforensics.analyze.coverage import (
    find_coverage,
    ring_failure,
    snapshot_corruption,
    summary_failure,
)
from qforensics.analyze.engine import find_engine_findings, warmup_steps, without_warmup
from qforensics.analyze.damage import predict_damage, rank_unsafe
from qforensics.analyze.evidence import (
    collect_evidence,
    flag_parameters,
    recorded_scheme,
    summarize_parameters,
)
from qforensics.analyze.findings import (
    FAILED,
    PASSED,
    SUSPECT,
    Cause,
    Findings,
    FirstNonfinite,
    Incident,
    MultiRankFindings,
    SnapshotRef,
    TraceEndInfo,
    Verdict,
)
from qforensics.analyze.gaps import find_gaps
from qforensics.analyze.nonfinite import find_first_bad_step, find_first_nonfinite
from qforensics.analyze.outliers import (
    RecordIndex,
    find_outlier_channels,
    find_persistent_outliers,
    load_step_channels,
    top_ratio_rows,
)
from qforensics.analyze.precursors import find_precursors, summary_owners
from qforensics.analyze.reference import compare_to_reference
from qforensics.analyze.thresholds import RATIONALE, Thresholds
from qforensics.analyze.verdict import cross_check, verdict_for
from qforensics.errors import TraceUnreadableError, UsageError
from qforensics.formats import GEMM_KINDS, KIND_ROOT
from qforensics.trace import schema
from qforensics.trace.moduleinfo import read_module_infos
from qforensics.trace.reader import Trace, open_trace
from qforensics.trace.table import Table

__all__ = ["analyze_open_trace", "analyze_trace", "analyze_traces", "verdict_for"]

_ENV_KEYS = ("qforensics", "torch", "transformers", "python", "model_class", "devices", "dtypes",
             "compiled", "rank", "world_size", "host", "scenario", "prompt")


def analyze_trace(path: str | os.PathLike[str], *,
                  reference: str | os.PathLike[str] | None = None, **thresholds: Any
                  ) -> Findings:
    """Analyze one trace. Keyword arguments are `Thresholds` fields (ratio=20.0, absolute=100.0,
    top=10, ...); `reference`: a trace of the same prompt from a reference run, compared in
    `Findings.reference`. Raises TraceFormatError (a QForensicsError) when a file is unusable; a
    NaN in the trace is a finding, not an error."""
    th = Thresholds.from_kwargs(**thresholds)
    t0 = time.perf_counter()
    with open_trace(path) as trace:
        f = analyze_open_trace(trace, th, reference=reference)
    f.seconds = round(time.perf_counter() - t0, 4)
    return f


def analyze_traces(paths: Iterable[str | os.PathLike[str]], **thresholds: Any
                   ) -> MultiRankFindings:
    """Analyze one trace per rank; the verdict names the earliest failure across ranks
    (lowest step, then earliest wall-clock start of that step, then call index)."""
    paths = list(paths)
    if not paths:
        raise UsageError("no trace given")
    found = [analyze_trace(p, **thresholds) for p in paths]
    found.sort(key=lambda f: (f.rank, f.trace))
    failed = [i for i, f in enumerate(found) if f.first_nonfinite is not None]
    earliest = None
    if failed:
        def key(i: int) -> tuple:
            fn = found[i].first_nonfinite
            assert fn is not None
            t = fn.t_start if math.isfinite(fn.t_start) else math.inf
            return (fn.step, t, fn.call_index)
        earliest = min(failed, key=key)
        f = found[earliest]
        line = (f"{FAILED} | earliest failure on rank {f.rank} of {len(found)} ({f.trace}): "
                + f.verdict.line.split(" | ", 1)[-1])
        others = [found[i].rank for i in failed if i != earliest]
        if others:
            line += f"; also failed: rank {', '.join(str(r) for r in others)}"
        verdict = Verdict(FAILED, line)
    else:
        sus = [f for f in found if f.status == SUSPECT]
        if sus:
            verdict = Verdict(SUSPECT, f"{SUSPECT} | rank {sus[0].rank} ({sus[0].trace}): "
                              + sus[0].verdict.line.split(" | ", 1)[-1]
                              + (f"; {len(sus) - 1} more suspect ranks" if len(sus) > 1 else ""))
        else:
            n = sum(f.n_steps for f in found)
            verdict = Verdict(PASSED, f"{PASSED} | no non-finite values on {len(found)} ranks "
                              f"({n} steps in all)")
    return MultiRankFindings(found, earliest, verdict)


# -- one trace -------------------------------------------------------------------------------------
def _environment(meta: dict[str, Any]) -> dict[str, Any]:
    env = meta.get("environment") if isinstance(meta.get("environment"), dict) else {}
    out = {k: env[k] for k in _ENV_KEYS if k in env}
    cuda = env.get("cuda")
    if isinstance(cuda, dict):
        out["cuda"] = {k: cuda[k] for k in ("available", "version", "device_name", "capability")
                       if k in cuda}
    if isinstance(env.get("fp8_cast"), dict):
        out["fp8_cast"] = {k: env["fp8_cast"][k] for k in ("e4m3fn", "e5m2")
                           if k in env["fp8_cast"]}
    oc = meta.get("outcome")
    if isinstance(oc, dict):
        out["outcome"] = {k: oc[k] for k in ("scenario", "weights", "activations",
                                              "first_nonfinite_step", "top1_agreement", "text")
                          if k in oc}
    return out


def _int(x: Any, default: int) -> int:
    try:
        return int(x)
    except (TypeError, ValueError, OverflowError):
        return default


def _peak_step(trace: Trace, steps: Table) -> int | None:
    """With no failure: the step whose linear-module inputs (with channel ranges) peak."""
    if steps.empty:
        return None
    cols = trace.record_columns(["step", "module_id", "io", "absmax", "chan_offset"])
    if not len(cols["step"]):
        return None
    kinds = trace.module_kinds
    mid = cols["module_id"]
    ok = (mid >= 0) & (mid < len(kinds))
    gemm = np.zeros(len(mid), bool)
    gemm[ok] = np.isin(kinds[mid[ok]], GEMM_KINDS)
    sel = gemm & (cols["io"] == schema.IO_INPUT) & (cols["chan_offset"] >= 0) & np.isfinite(
        cols["absmax"])
    if not sel.any():
        sel = gemm & (cols["io"] == schema.IO_INPUT) & np.isfinite(cols["absmax"])
    if not sel.any():
        return int(steps["step"][-1])
    i = np.nonzero(sel)[0]
    return int(cols["step"][i[np.argmax(cols["absmax"][i])]])


def _focus_rows(recs: Table, first: FirstNonfinite) -> list[int]:
    """Records whose channels explain the failure: the producer's inputs, or for a gap the
    input that already holds the value and the last finite hooked output before it."""
    call, io, row = recs["call_index"], recs["io"], recs["row"]
    if first.producer_module is not None:
        return row[(call == first.call_index) & (io == schema.IO_INPUT)].tolist()
    gap = first.producer
    rows = row[(call == first.call_index) & (io == schema.IO_INPUT)
               & (recs["slot"] == first.slot)].tolist()
    if gap.last_finite_call is not None:  # type: ignore[union-attr]
        rows += row[(call == gap.last_finite_call)  # type: ignore[union-attr]
                    & (io == schema.IO_OUTPUT)].tolist()[:1]
    return rows


def analyze_open_trace(trace: Trace, th: Thresholds | None = None, *,
                       reference: str | os.PathLike[str] | None = None,
                       reference_diff: Any = None, verdict_only: bool = False) -> Findings:
    """The analysis on an already open trace (the report and replay reuse it).
    `reference_diff`: `diff_traces(reference, trace, top=100000)` when already computed.

    `verdict_only` (triage's per-trace task): the same verdict, status, first non-finite value,
    cause, evidence, notes and snapshots, without the parts that only the report shows and that
    read nothing from the file: the persistent outliers, the damage of every scheme to every
    module (kept only where a module's recorded activation scheme makes it evidence), the
    unsafe-scheme ranking and the parameter lists. Those fields are left empty."""
    th = th or Thresholds()
    steps = trace.step_table
    end = trace.end
    meta = trace.meta
    env = _environment(meta)
    raw_env = meta.get("environment") if isinstance(meta.get("environment"), dict) else {}
    notes: list[str] = []
    if not end.complete or not end.reason.startswith("complete"):
        notes.append(end.reason)

    _guarded(trace, lambda: trace.module_columns, None)  # validates the module kinds up front
    # a serving engine's warm-up / profile forwards are recorded but never drive a verdict
    warm = warmup_steps(trace)
    steps = without_warmup(steps, warm)
    fail_row = find_first_bad_step(steps, warmup=warm)
    fail_row = cross_check(trace, steps, fail_row, notes, warm)
    cov = _guarded(trace, lambda: find_coverage(trace, steps, warm), None)
    first = None
    focus: list[int] = []
    recs = None
    summary_only = None  # (step, call) when the failing step's records cannot be read
    logits_only = None  # (step, NaN, Inf) when only the failing step's logits hold NaN/Inf
    fail_steps, fail_at = steps, fail_row
    focus_step: int | None = None
    early = summary_failure(cov, steps, fail_row)  # first failure only the summaries show
    if early is not None:
        hit = ring_failure(trace, early)
        if hit is not None:
            (fail_steps, recs), fail_at = hit, 0
        else:
            summary_only, fail_at = (early, cov.first_nonfinite_call), None  # type: ignore
    if fail_at is not None:
        fstep = int(fail_steps["step"][fail_at])
        focus_step = fstep
        try:
            recs = trace.record_table(fstep) if recs is None else recs
        except TraceUnreadableError as exc:
            trace.unreadable.append(str(exc))
            summary_only = (fstep, int(fail_steps["first_nonfinite_call"][fail_at]))
            recs = focus_step = None
        else:
            first = find_first_nonfinite(trace, fail_steps, fail_at, recs)
            if first is None:  # no recorded tensor holds NaN/Inf: its logits alone, or nothing
                srow = fail_steps.row(fail_at)
                lnan, linf = int(srow["logits_nan"]), int(srow["logits_inf"])
                if lnan + linf > 0:
                    logits_only = (fstep, lnan, linf)
                else:
                    notes.append(f"the per-step summary of step {fstep} says NaN/Inf but "
                                 "none of its records or logits holds any: the records are "
                                 "trusted")
            else:
                focus = _focus_rows(recs, first)
    elif summary_only is None:
        focus_step = _guarded(trace, lambda: _peak_step(trace, steps), None)
        if focus_step is not None:
            recs = _guarded(trace, lambda: trace.record_table(focus_step), None)

    outliers, persistent, damage, unsafe = [], [], [], []
    damage_rows: list[Any] = []  # verdict_only: the rows the damage is predicted on
    vocab = None
    sc = None
    try:
        if recs is not None and focus_step is not None:
            sc = load_step_channels(trace, focus_step, recs, focus)
            index = RecordIndex(trace)
            if first is not None:
                rows = [sc.by_row[r] for r in focus if r in sc.by_row]
                if not rows:
                    notes.append(f"no per-channel ranges stored for the inputs of call "
                                 f"{first.call_index} at step {focus_step}: outlier channels unknown")
            else:
                rows = top_ratio_rows(sc, int(th.top))
            outliers = find_outlier_channels(trace, rows, th, index)
            finite = [r for r in sc.rows
                      if int(r.rec["nan_count"]) + int(r.rec["inf_count"]) == 0]
            if len(finite) < len(sc.rows):
                notes.append(f"{len(sc.rows) - len(finite)} module inputs at step {focus_step} hold "
                             "NaN/Inf: left out of the persistent outliers and the damage prediction")
            sc.rows = finite
            gemm = sc.gemm_rows()
            if verdict_only:  # the damage that evidence reads, once the module infos are in
                damage_rows = gemm
            else:
                persistent = find_persistent_outliers(sc, th)
            if gemm:
                if not verdict_only:
                    damage = predict_damage(gemm, th)
                    unsafe = rank_unsafe(damage, th)
            else:
                notes.append(f"no linear module input with per-channel ranges at step {focus_step}: "
                             "no damage prediction")
            kinds = trace.module_kinds
            root = np.nonzero((kinds[recs["module_id"]] == KIND_ROOT)
                              & (recs["io"] == schema.IO_OUTPUT))[0] if len(recs) else []
            if len(root):
                vocab = int(recs["channels"][root[0]])
    except TraceUnreadableError as exc:
        trace.unreadable.append(str(exc))
        notes.append(f"outlier channels and damage left out: {exc}")
    precursors = find_precursors(steps, meta, th, fail_row=fail_row, vocab=vocab,
                                 owners=summary_owners(trace, steps)) if len(steps) else []
    infos = read_module_infos(trace)
    if infos.invalid:
        notes.append(f"{infos.invalid} malformed module info values ignored")
    cause = nonfinite_logits = None
    if first is not None and recs is not None:
        cause = classify_cause(trace, recs, first, infos, outliers)
        cause = _snapshot_cause(trace, first, cause)
    if (first is not None and recs is not None) or logits_only is not None:
        nonfinite_logits = describe_nonfinite_logits(trace, steps)
    if damage_rows:  # per module, so the recorded schemes' rows alone give the same damage
        want = {m for m, q in infos.quant.items() if recorded_scheme(q)}
        damage = predict_damage([r for r in damage_rows if r.module in want], th)
    evidence = collect_evidence(trace, infos, sc.gemm_rows() if sc is not None else [], damage,
                                precursors, th)

    snaps = _snapshot_refs(_guarded(trace, lambda: trace.snapshot_table, None))
    inc = _guarded(trace, lambda: trace.incident_table, None)
    incidents = [
        Incident(int(r["step"]), int(r["call_index"]), str(r["module"]), str(r["action"]),
                 int(r["nan_count"]), int(r["inf_count"]), str(r["detail"]))
        for r in (inc.row(i) for i in range(len(inc) if inc is not None else 0))
    ]
    engine = find_engine_findings(
        trace, first.step if first is not None else None,
        first.module if first is not None and first.tensor == "output" else None, steps=steps,
        nonfinite_steps=cov.nonfinite_steps if cov is not None and cov.summaries else None)
    if engine is not None:
        notes.extend(engine.lines())
    ref = (compare_to_reference(reference, trace, infos, diff=reference_diff)
           if reference is not None else None)
    gaps = _guarded(trace, lambda: find_gaps(trace, steps), None)
    verdict = verdict_for(first, precursors, len(steps), end, trace.unreadable, cause=cause,
                          evidence=evidence, coverage=cov, gaps=gaps.line() if gaps else "",
                          note=gaps.note() if gaps else "")
    if summary_only is not None:
        verdict = Verdict(FAILED, f"{FAILED} | the step summaries record NaN/Inf at step "
                          f"{summary_only[0]} (first at call {summary_only[1]}), but that step's "
                          "records could not be read: producer unknown"
                          + (f"; {cov.line()}" if cov is not None and cov.thinned else ""))
    if logits_only is not None:
        ls, lnan, linf = logits_only
        verdict = Verdict(FAILED, f"{FAILED} | the logits of step {ls} hold {lnan:,} NaN and "
                          f"{linf:,} Inf, but none of its recorded tensors does: produced after "
                          "the last hooked module (an unhooked op or the logits computation)"
                          + (f"; {cov.line()}" if cov is not None and cov.thinned else ""))
    for item in dict.fromkeys(trace.unreadable):
        if not any(item in n for n in notes):
            notes.append(f"could not read: {item}")
    if incidents:
        acts = sorted({i.action for i in incidents})
        verdict = Verdict(verdict.status, verdict.line + f" (runtime guard: {len(incidents)} "
                          f"incidents, {', '.join(acts)})")
    return Findings(
        trace=trace.path, rank=_int(raw_env.get("rank"), 0),
        world_size=_int(raw_env.get("world_size"), 1), n_steps=len(steps),
        n_modules=trace.n_modules, end=TraceEndInfo(end.complete, end.last_step, end.reason),
        environment=env, verdict=verdict, first_nonfinite=first, outliers=outliers,
        outlier_step=focus_step, persistent=persistent, damage=damage, unsafe=unsafe,
        damage_step=focus_step if damage else None, precursors=precursors, snapshots=snaps,
        thresholds=th.to_dict(), notes=notes, incidents=incidents, cause=cause,
        nonfinite_logits=nonfinite_logits, evidence=evidence,
        parameters=[] if verdict_only else flag_parameters(infos, th)[:int(th.top) * 5],
        tied=infos.tied,
        parameter_summary={} if verdict_only else summarize_parameters(infos, th),
        thresholds_rationale=dict(RATIONALE), reference=ref, engine=engine,
        coverage=({**cov.to_dict(), **({"gaps": gaps.to_dict()} if gaps else {})}
                  if cov is not None else None),
    )


def _snapshot_cause(trace: Trace, first: FirstNonfinite, cause: Cause) -> Cause:
    """Corrupt parameters seen in the producer's snapshot (after attach, so the parameter
    health taken at attach did not see them) name the cause."""
    if cause.kind == "corrupted_parameters" or first.producer_module is None:
        return cause
    bad = snapshot_corruption(trace, first.call_index)
    if not bad:
        return cause
    words = "; ".join(f"{first.module}.{b['param']}: {b['nan']} NaN, {b['inf']} Inf of "
                      f"{b['numel']} in the snapshot of call {first.call_index}, first at row "
                      f"{b['row']}" + (f", col {b['col']}" if b["col"] is not None else "")
                      for b in bad)
    return Cause("corrupted_parameters", f"cause: corrupted parameters of {words} (corrupted "
                 "after attach: the parameter health taken then was finite)", first.module,
                 [{**b, "words": words} for b in bad])


def _snapshot_refs(snaps: Table | None) -> list[SnapshotRef]:
    """One reference per (call, reason), sorted by both; the tensor names in file order."""
    if snaps is None or not len(snaps):
        return []
    groups: dict[tuple[int, str], list[int]] = {}
    for i, (ci, reason) in enumerate(zip(snaps["call_index"].tolist(), snaps["reason"])):
        groups.setdefault((int(ci), str(reason)), []).append(i)
    return [SnapshotRef(ci, int(snaps["step"][rows[0]]), str(snaps["module"][rows[0]]), reason,
                        [str(snaps["name"][i]) for i in rows])
            for (ci, reason), rows in sorted(groups.items())]


def _guarded(trace: Trace, get: Any, default: Any) -> Any:
    try:
        return get()
    except TraceUnreadableError as exc:
        trace.unreadable.append(str(exc))
        return default
