"""The verdict of one trace (`verdict_for`) and the cross-check of its per-step summaries
against its records' NaN/Inf counts. Pure functions of what the analysis found; no torch."""

from __future__ import annotations

from typing import Any

import numpy as np

from qforensics.analyze.coverage import Coverage
from qforensics.analyze.evidence import output_evidence
from qforensics.analyze.findings import (
    FAILED,
    PASSED,
    SUSPECT,
    Cause,
    Evidence,
    FirstNonfinite,
    Verdict,
)
from qforensics.analyze.nonfinite import kind_word
from qforensics.analyze.thresholds import Thresholds
from qforensics.trace.reader import Trace
from qforensics.trace.table import Table

__all__ = ["cross_check", "verdict_for"]


def cross_check(trace: Trace, steps: Table, fail_row: int | None,
                 notes: list[str], warm: np.ndarray) -> int | None:
    """The per-step summaries against a scan of every record's NaN/Inf counts: a step whose
    records hold NaN/Inf is failing even when its summary (damaged, or written by a killed run)
    says otherwise. A warm-up forward's records (vLLM's dummy batch) never count."""
    bad_steps = trace.nonfinite_record_steps()
    bad_steps = bad_steps[~np.isin(bad_steps, warm)]
    if not len(bad_steps) or not len(steps):
        return fail_row
    rows = np.nonzero(np.isin(steps["step"], bad_steps))[0]
    if not len(rows) or (fail_row is not None and fail_row <= int(rows[0])):
        return fail_row
    row = int(rows[0])
    notes.append(f"the per-step summary of step {int(steps['step'][row])} says it is "
                 "finite but its records hold NaN/Inf: the records are trusted")
    trace.unreadable.append("/steps summaries disagree with the records' NaN/Inf counts")
    return row


def verdict_for(first: FirstNonfinite | None, precursors: list, n_steps: int,
                end: Any, unreadable: list[str] | None = None, *, cause: Cause | None = None,
                evidence: list[Evidence] | None = None,
                coverage: Coverage | None = None, gaps: str = "", note: str = "") -> Verdict:
    """FAILED with a non-finite value (naming its cause), SUSPECT with silent-failure evidence
    (parameters and activations first, then the output), when anything was `unreadable` or
    when recording stopped with no summaries of the steps after it, else PASSED. Where
    detail was thinned, the line says which steps it covers and at what resolution. `gaps`:
    what the steps recorded in full lack (`Gaps.line`): never PASSED over modules not seen.
    `note`: what the line also says, whatever it reads (`Gaps.note`: steps whose detail
    compiled mode gave up, their NaN/Inf check kept)."""
    tail = "" if end.complete else f" (trace truncated after step {end.last_step})"
    if note:
        tail += f"; {note}"
    if coverage is not None and coverage.thinned:
        tail += f"; {coverage.line()}"
        if coverage.summaries:
            n_steps = coverage.steps_seen
    if first is not None:
        word = kind_word(first.kind)
        head = f"{FAILED} | first non-finite at step {first.step}, call {first.call_index}: "
        why = f"; {cause.line}" if cause is not None and cause.kind not in (
            "unhooked_op", "undetermined") else ""
        if first.producer_module is not None:
            return Verdict(FAILED, head + f"{first.module} produced {word} from finite input"
                           + why + tail)
        gap = first.producer
        where = (f"after call {gap.last_finite_call} ({gap.last_finite_module})"  # type: ignore
                 if gap.last_finite_call is not None else "before it")  # type: ignore
        return Verdict(FAILED, head + f"{word} already in the input of {first.module}; "
                       f"produced by an unhooked op {where}" + why + tail)
    if evidence is None:  # callers that only have the precursors
        evidence = output_evidence(precursors, Thresholds())
    silent = [e for e in evidence if e.suspect]
    if silent:
        more = f" (+{len(silent) - 1} more)" if len(silent) > 1 else ""
        return Verdict(SUSPECT, f"{SUSPECT} | no NaN, but {silent[0].line}{more}" + tail)
    if coverage is not None and coverage.writer_error and not coverage.blind:
        # the capture's own failure to write (a full disk), not damage from outside: its step
        # and cause first; the coverage (tail) says what the file still holds
        also = f"; {unreadable[0]}" if unreadable else ""
        return Verdict(SUSPECT, f"{SUSPECT} | no non-finite values in {n_steps} steps, but "
                       f"trace writing failed at step {coverage.stopped_at} "
                       f"({coverage.writer_error}), later steps are in the summaries and the ring "
                       f"only{also}" + tail)
    if unreadable:
        more = f" (+{len(unreadable) - 1} more)" if len(unreadable) > 1 else ""
        return Verdict(SUSPECT, f"{SUSPECT} | no non-finite values in the {n_steps} steps that "
                       f"could be read, but the trace is damaged: {unreadable[0]}{more}" + tail)
    if n_steps == 0:
        return Verdict(SUSPECT, f"{SUSPECT} | no complete step in the trace: nothing to analyze"
                       + tail)
    if gaps:
        return Verdict(SUSPECT, f"{SUSPECT} | no non-finite values in {n_steps} steps, but "
                       f"{gaps}" + tail)
    if coverage is not None and coverage.blind:
        return Verdict(SUSPECT, f"{SUSPECT} | no non-finite values in the {n_steps} steps "
                       "recorded in full, but the steps after them were not seen" + tail)
    if not end.complete or not end.reason.startswith("complete"):
        return Verdict(SUSPECT, f"{SUSPECT} | no non-finite values in {n_steps} steps, but the run "
                       f"did not finish normally: {end.reason}")
    return Verdict(PASSED, f"{PASSED} | no non-finite values in {n_steps} steps" + tail)
