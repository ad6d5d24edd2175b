"""Verdicts: what a replay measured, in one line each, plus the versioned JSON result.

KERNEL FAULT     compute-sanitizer saw an illegal access by the named kernel (first record attached)
KERNEL DIVERGES  the float64 reference is finite; the kernel's output is non-finite or beyond the
                 stated tolerance (coordinates attached)
DATA             the kernel agrees with the float64 reference, which is itself non-finite: the
                 recorded inputs or parameters make the NaN (channels / groups named)
NOT REPRODUCED   the kernel ran on the recorded data: 0 sanitizer errors, or agreement with a
                 finite reference
INCONCLUSIVE     nothing was measured, with the reason (no GPU, no sanitizer, the run's kernel
                 cannot be called here, target died before the first instrumented call, ...)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from qforensics.jsondoc import document
from qforensics.replay.records import (
    AccessRecord,
    ApiError,
    OtherError,
    SanitizerReport,
)

RESULT_SCHEMA = "qforensics.replay"  # its version: qforensics.jsondoc.SCHEMAS


class Verdict(str, Enum):
    KERNEL_FAULT = "KERNEL FAULT"
    KERNEL_DIVERGES = "KERNEL DIVERGES"
    DATA = "DATA"
    NOT_REPRODUCED = "NOT REPRODUCED"
    INCONCLUSIVE = "INCONCLUSIVE"


@dataclass
class ReplayResult:
    """One path's outcome (GPU run or emulation)."""

    verdict: Verdict
    path: str  # "kernel" (numeric, CPU or CUDA) | "sanitizer" | "launcher" | "fixture-emulation"
    summary: str
    reason: str | None = None
    first: AccessRecord | ApiError | OtherError | None = None
    errors: int = 0
    details: dict[str, Any] = field(default_factory=dict)
    bound_model: dict[str, Any] | None = None  # numeric legs: the error-bound model judged by (bounds.py)

    @property
    def failing(self) -> bool:
        return self.verdict in (Verdict.KERNEL_FAULT, Verdict.KERNEL_DIVERGES, Verdict.DATA)

    def line(self) -> str:
        return f"{self.verdict.value} | {self.summary}"

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict.value, "path": self.path, "summary": self.summary, "reason": self.reason,
                "errors": self.errors, "first": self.first.to_dict() if self.first is not None else None,
                "bound_model": self.bound_model, "details": self.details}


def judge_sanitizer(report: SanitizerReport, *, kernel_ran: bool, print_limit: int, path: str = "sanitizer",
                    timed_out: bool = False) -> ReplayResult:
    """Turn a parsed sanitizer run into a verdict. Never reports a clean result it did not see."""
    n = report.error_summary
    hidden = report.not_displayed or (max(0, n - report.printed_errors) if n is not None else 0)
    limit_hit = hidden > 0 and print_limit > 0 and report.printed_errors >= print_limit
    if timed_out:
        return ReplayResult(Verdict.INCONCLUSIVE, path, "the sanitizer run timed out (see raw output)", reason="timeout")
    if report.terminated_before_instrumentation:
        return ReplayResult(Verdict.INCONCLUSIVE, path,
                            "target died before the first instrumented CUDA call (no usable GPU/driver, or it crashed early)",
                            reason="target died before first instrumented call")
    if report.records:
        first = report.records[0]
        extra = f"; {hidden} more not printed (print limit)" if limit_hit else ""
        return ReplayResult(Verdict.KERNEL_FAULT, path, first.describe() + extra, first=first,
                            errors=n if n is not None else len(report.records))
    if report.other_errors:
        first_o = report.other_errors[0]
        return ReplayResult(Verdict.KERNEL_FAULT, path, first_o.message, first=first_o,
                            errors=n if n is not None else len(report.other_errors))
    if limit_hit or (n and report.printed_errors == 0):
        return ReplayResult(Verdict.INCONCLUSIVE, path,
                            f"{n} errors counted but the access records were not printed; rerun with --print-limit 0",
                            reason="print limit hit", errors=n or 0)
    if report.api_errors:
        e = report.api_errors[0]
        return ReplayResult(Verdict.KERNEL_FAULT, path,
                            f"{e.name} (error {e.number}) on {e.call or 'a CUDA API call'}, but no access record "
                            "was printed (kernel filtered out, or the fault is outside the instrumented kernels)",
                            first=e, errors=n if n is not None else len(report.api_errors))
    if n is None:
        return ReplayResult(Verdict.INCONCLUSIVE, path, "no ERROR SUMMARY line: the sanitizer or the target crashed (see raw output)",
                            reason="no error summary")
    if n == 0 and kernel_ran:
        return ReplayResult(Verdict.NOT_REPRODUCED, path, "0 errors; the kernel ran to completion on this tile")
    if n == 0:
        return ReplayResult(Verdict.INCONCLUSIVE, path, "0 errors, but there is no sign the kernel ran (see raw output)",
                            reason="kernel did not run")
    return ReplayResult(Verdict.INCONCLUSIVE, path, f"{n} errors reported but none could be parsed (see raw output)",
                        reason="unparsed output", errors=n)


def inconclusive(path: str, reason: str, summary: str) -> ReplayResult:
    return ReplayResult(Verdict.INCONCLUSIVE, path, summary, reason=reason)


def result_document(results: list[ReplayResult], *, bundle_path: str | None, meta: dict[str, Any]) -> dict[str, Any]:
    """The versioned JSON document written by `--json` (schema in docs/replay.md)."""
    from qforensics.version import __version__

    return document(RESULT_SCHEMA, {
        "created_by": f"qforensics {__version__}",
        "bundle": bundle_path,
        "call_index": meta.get("call_index"),
        "module": meta.get("module"),
        "layout": meta.get("layout"),
        "fixture": bool(meta.get("fixture")),
        "library": meta.get("library"),
        "kernel": meta.get("kernel"),
        "shapes": {k: meta.get(k) for k in ("M", "M_full", "N", "N_full", "K", "group_size", "compute_dtype")},
        "tile": {k: meta.get(k) for k in ("row_start", "row_stop", "col_start", "col_stop", "first_nonfinite")},
        "results": [r.to_dict() for r in results],
    })
