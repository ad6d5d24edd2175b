"""Pure functions trace -> findings: the first non-finite value and the module (or unhooked op)
that produced it, the outlier channels responsible, predicted quantization damage, precursors
and silent failures, and divergence from a reference trace.

    >>> from qforensics.analyze import analyze_trace
    >>> f = analyze_trace("trace.h5")          # doctest: +SKIP
    >>> f.verdict.line                         # doctest: +SKIP
    'FAILED | first non-finite at step 0, call 683: model.layers.11.mlp.down_proj produced NaN ...'

Reads only what it needs: the per-step summaries, the records of the failing step, and the
per-channel ranges of one step. Never imports torch; never prints.
"""

from __future__ import annotations

from qforensics.analyze.analyzer import analyze_trace, analyze_traces
from qforensics.analyze.diff import diff_traces
from qforensics.analyze.findings import (
    FAILED,
    PASSED,
    SCHEMA_NAME,
    SCHEMA_VERSION,
    SUSPECT,
    DiffFindings,
    Divergence,
    Findings,
    FirstNonfinite,
    Gap,
    MultiRankFindings,
    OutlierChannel,
    PersistentOutlier,
    Precursor,
    SchemeDamage,
    SnapshotRef,
    Spread,
    TraceEndInfo,
    TrendPoint,
    UnsafeModules,
    Verdict,
)
from qforensics.analyze.thresholds import Thresholds

__all__ = [
    "FAILED",
    "PASSED",
    "SCHEMA_NAME",
    "SCHEMA_VERSION",
    "SUSPECT",
    "DiffFindings",
    "Divergence",
    "Findings",
    "FirstNonfinite",
    "Gap",
    "MultiRankFindings",
    "OutlierChannel",
    "PersistentOutlier",
    "Precursor",
    "SchemeDamage",
    "SnapshotRef",
    "Spread",
    "Thresholds",
    "TraceEndInfo",
    "TrendPoint",
    "UnsafeModules",
    "Verdict",
    "analyze_trace",
    "analyze_traces",
    "diff_traces",
]
