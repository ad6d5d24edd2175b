"""Findings -> a self-contained HTML incident report (plots inline, no network, CSP-locked).

    >>> from qforensics.reports import write_report
    >>> r = write_report("trace.h5", "incident.html")            # doctest: +SKIP
    >>> r.verdict.line                                            # doctest: +SKIP
    'FAILED | first non-finite at step 0, call 94: model.layers.11.mlp.down_proj produced NaN ...'

Everything taken from a trace, a replay or a what-if result is untrusted and escaped. Never prints; never
imports torch.
"""

from __future__ import annotations

from qforensics.reports.replay_result import (
    ReplayEntry,
    ReplaySummary,
    load_replay_result,
    parse_replay_result,
)
from qforensics.reports.report import (
    ReportResult,
    build_context,
    content_security_policy,
    render_report,
    write_report,
)
from qforensics.reports.whatif_result import (
    WhatIfRow,
    WhatIfSummary,
    load_whatif_result,
    parse_whatif_result,
)

__all__ = [
    "ReplayEntry",
    "ReplaySummary",
    "ReportResult",
    "WhatIfRow",
    "WhatIfSummary",
    "build_context",
    "content_security_policy",
    "load_replay_result",
    "load_whatif_result",
    "parse_replay_result",
    "parse_whatif_result",
    "render_report",
    "write_report",
]
