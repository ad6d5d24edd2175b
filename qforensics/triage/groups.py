"""Triage rows -> incidents -> incident groups, and what sets each group apart.

An incident is one run: the rank files of one TP/PP group (`names.run_key`) are one incident,
named by its first rank, the one whose failure comes first (lowest step, then the earliest
wall-clock start of that step, then call index; with no failure, the lowest SUSPECT rank), as
`analyze` does for several ranks. Incidents with the same signature form a group; groups are
ranked by count, then by first time. Each group keeps one representative trace (its earliest
incident's first rank) and the attribute values that set its traces apart from the healthy
ones. Pure functions on plain dicts; never prints; no torch import.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from qforensics.analyze.findings import FAILED, PASSED, SUSPECT
from qforensics.errors import EXIT_FINDING, EXIT_INTERNAL, EXIT_OK, EXIT_USAGE
from qforensics.jsondoc import SCHEMAS, document, jsonable
from qforensics.triage.summary import UNREADABLE

__all__ = ["COMPARED", "SCHEMA_NAME", "SCHEMA_VERSION", "SIGNATURE", "Fleet", "Group",
           "Incident", "build_fleet"]

SCHEMA_NAME = "qforensics.triage"  # Fleet.to_dict, docs/triage.md
SCHEMA_VERSION = SCHEMAS[SCHEMA_NAME]

# what a group's signature is made of (row keys)
SIGNATURE = ("status", "producer", "cause", "cause_index", "method", "kernel", "engine",
             "engine_version", "torch", "model")
# what affected traces are compared with healthy ones on: (label, row keys joined)
COMPARED = (("engine", ("engine", "engine_version")), ("torch", ("torch",)),
            ("model", ("model",)), ("kernels", ("kernels",)), ("quantization", ("methods",)),
            ("prompt length", ("prompt_bucket",)), ("host", ("host",)),
            ("compiled", ("compiled",)), ("dtype", ("dtype",)))
MIN_AFFECTED_SHARE = 0.6  # a value held by at least this share of a group's incidents ...
MIN_LIFT = 0.5  # ... and by this much less of the healthy runs sets the group apart


def _time(row: dict[str, Any]) -> float:
    t = row.get("time", math.nan)
    return float(t) if isinstance(t, (int, float)) and math.isfinite(t) else math.inf


@dataclass
class Incident:
    """One run: all its rank files (`rows`) and the first rank (`first`) that names it."""

    run: str
    rows: list[dict[str, Any]]
    first: dict[str, Any]

    @property
    def status(self) -> str:
        return str(self.first["status"])

    @property
    def time(self) -> float:
        return min(_time(r) for r in self.rows)

    @property
    def paths(self) -> list[str]:
        return [str(r["path"]) for r in self.rows]


@dataclass
class Group:
    """Incidents sharing one signature. `count` counts incidents (runs); `traces` lists every
    trace file of them, ranks included."""

    id: int
    signature: dict[str, Any]
    incidents: list[Incident]
    apart: list[dict[str, Any]] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.incidents)

    @property
    def traces(self) -> list[str]:
        return [p for i in self.incidents for p in i.paths]

    @property
    def first_time(self) -> float:
        return min(i.time for i in self.incidents)

    @property
    def representative(self) -> dict[str, Any]:
        return min(self.incidents, key=lambda i: (i.time, i.first["path"])).first

    @property
    def status(self) -> str:
        return str(self.signature["status"])

    @property
    def cause_text(self) -> str:
        s = self.signature
        return s["cause"] + (f" ({s['cause_index']})" if s["cause_index"] else "")

    def to_dict(self) -> dict[str, Any]:
        rep = self.representative
        return {"id": self.id, "verdict": self.status, "producer": self.signature["producer"],
                "cause": self.cause_text, "count": self.count, "traces": self.traces,
                "signature": dict(self.signature), "site": rep.get("site", ""),
                "first_time": None if math.isinf(self.first_time) else self.first_time,
                "representative": rep["path"], "verdict_line": rep.get("verdict", ""),
                "first_rank": rep.get("rank", 0),
                "ranks": sorted({int(r.get("rank", 0)) for i in self.incidents for r in i.rows}),
                "apart": self.apart}


@dataclass
class Fleet:
    rows: list[dict[str, Any]]  # one per trace given, unreadable ones included
    groups: list[Group]  # FAILED / SUSPECT groups, by count then first time
    healthy: list[Incident]
    unreadable: list[dict[str, Any]]

    @property
    def by_first_time(self) -> list[Group]:
        return sorted(self.groups, key=lambda g: (g.first_time, -g.count, g.id))

    @property
    def internal_errors(self) -> list[dict[str, Any]]:
        return [r for r in self.unreadable if r.get("internal")]

    @property
    def exit_code(self) -> int:
        """3 when any trace met a bug in qforensics (never read as a finding), 1 with a FAILED
        or SUSPECT group, 2 when traces were unreadable and nothing was found, else 0."""
        if self.internal_errors:
            return EXIT_INTERNAL
        if self.groups:
            return EXIT_FINDING
        if self.unreadable:
            return EXIT_USAGE
        return EXIT_OK

    def to_dict(self) -> dict[str, Any]:
        return document(SCHEMA_NAME, jsonable({
            "traces": len(self.rows), "healthy": sum(len(i.rows) for i in self.healthy),
            "groups": [g.to_dict() for g in self.groups],
            "unreadable": [{"path": r["path"], "reason": r["reason"],
                            "internal": bool(r.get("internal"))} for r in self.unreadable]}))


def _first_rank(rows: list[dict[str, Any]]) -> dict[str, Any]:
    failed = [r for r in rows if r["status"] == FAILED]
    if failed:
        return min(failed, key=lambda r: (r["step"] if r["step"] >= 0 else math.inf, _time(r),
                                          r["call_index"], r["rank"], r["path"]))
    sus = [r for r in rows if r["status"] == SUSPECT]
    pool = sus or rows
    return min(pool, key=lambda r: (r["rank"], r["path"]))


def _incidents(rows: list[dict[str, Any]]) -> list[Incident]:
    runs: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        runs.setdefault(str(r["run"]), []).append(r)
    return [Incident(k, sorted(v, key=lambda r: (r["rank"], r["path"])), _first_rank(v))
            for k, v in runs.items()]


def _value(row: dict[str, Any], keys: tuple[str, ...]) -> str:
    return " ".join(str(row.get(k, "")) for k in keys).strip() or "-"


def set_apart(affected: list[dict[str, Any]], healthy: list[dict[str, Any]]
              ) -> list[dict[str, Any]]:
    """Attribute values held by most affected runs and by far fewer healthy runs."""
    out = []
    if not affected:
        return out
    for label, keys in COMPARED:
        counts = Counter(_value(r, keys) for r in affected)
        value, n = counts.most_common(1)[0]
        a = n / len(affected)
        h = (sum(1 for r in healthy if _value(r, keys) == value) / len(healthy)
             if healthy else None)
        if a >= MIN_AFFECTED_SHARE and (h is None or a - h >= MIN_LIFT):
            out.append({"attribute": label, "value": value, "affected_share": round(a, 4),
                        "healthy_share": None if h is None else round(h, 4),
                        "affected": n, "of_affected": len(affected),
                        "healthy": None if h is None else round(h * len(healthy)),
                        "of_healthy": len(healthy)})
    out.sort(key=lambda d: -(d["affected_share"] - (d["healthy_share"] or 0.0)))
    return out


def build_fleet(rows: list[dict[str, Any]]) -> Fleet:
    """Group the triage rows (summary.summarize_trace) of a fleet."""
    bad = [r for r in rows if r["status"] == UNREADABLE]
    good = [r for r in rows if r["status"] != UNREADABLE]
    incidents = _incidents(good)
    healthy = [i for i in incidents if i.status == PASSED]
    keyed: dict[tuple, list[Incident]] = {}
    for inc in incidents:
        if inc.status == PASSED:
            continue
        key = tuple(str(inc.first.get(k, "")) for k in SIGNATURE)
        keyed.setdefault(key, []).append(inc)
    groups = [Group(0, dict(zip(SIGNATURE, key)), sorted(incs, key=lambda i: (i.time, i.run)))
              for key, incs in keyed.items()]
    groups.sort(key=lambda g: (-g.count, g.first_time, g.signature["producer"], g.traces[0]))
    healthy_rows = [i.first for i in healthy]
    for n, g in enumerate(groups, 1):
        g.id = n
        g.apart = set_apart([i.first for i in g.incidents], healthy_rows)
    return Fleet(sorted(rows, key=lambda r: str(r["path"])), groups, healthy,
                 sorted(bad, key=lambda r: str(r["path"])))
