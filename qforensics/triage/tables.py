"""The fleet as one Parquet table: one row per trace (`kind` "trace") and one per incident group
(`kind` "group"), columns in docs/triage.md. Trace rows name their `group` (0: healthy or
unreadable); group rows carry the count, the representative, both rankings and what sets the
group apart (`apart`, JSON text). Written with pandas + pyarrow. No torch import.
"""

from __future__ import annotations

import math
import os
from typing import Any

from qforensics.atomic import replacing
from qforensics.errors import QForensicsError, UsageError
from qforensics.jsondoc import dumps
from qforensics.triage.groups import Fleet

__all__ = ["COLUMNS", "fleet_frame", "write_parquet"]

# column -> default (its type too)
COLUMNS: dict[str, Any] = {
    "kind": "", "group": 0, "path": "", "status": "", "verdict": "", "reason": "",
    "internal": False, "run": "", "rank": 0, "world_size": 1, "tp_rank": 0, "pp_rank": 0,
    "first_rank": False, "engine": "", "engine_version": "", "torch": "", "model": "",
    "host": "", "compiled": False, "dtype": "", "kernels": "", "methods": "", "producer": "",
    "producer_raw": "", "site": "", "cause": "", "cause_index": "", "cause_line": "",
    "method": "", "kernel": "", "step": -1, "call_index": -1, "time": math.nan,
    "prompt_tokens": -1, "prompt_bucket": "", "n_steps": 0, "seconds": 0.0, "count": 0,
    "n_traces": 0, "representative": "", "rank_count": 0, "rank_first": 0, "apart": "",
    "report": "",
}


def _clean(row: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, default in COLUMNS.items():
        v = row.get(k, default)
        if isinstance(default, bool):
            v = bool(v)
        elif isinstance(default, int):
            v = int(v) if isinstance(v, (int, float)) and math.isfinite(v) else default
        elif isinstance(default, float):
            v = float(v) if isinstance(v, (int, float)) else default
        else:
            v = "" if v is None else str(v)
        out[k] = v
    return out


def fleet_rows(fleet: Fleet, reports: dict[str, str] | None = None) -> list[dict[str, Any]]:
    reports = reports or {}
    member: dict[str, int] = {}
    firsts: set[str] = set()
    for g in fleet.groups:
        for inc in g.incidents:
            firsts.add(inc.first["path"])
            for p in inc.paths:
                member[p] = g.id
    for inc in fleet.healthy:
        firsts.add(inc.first["path"])
    out = []
    for r in fleet.rows:
        out.append(_clean({**r, "kind": "trace", "group": member.get(r["path"], 0),
                           "first_rank": r["path"] in firsts,
                           "report": reports.get(r["path"], "")}))
    by_first = {g.id: n for n, g in enumerate(fleet.by_first_time, 1)}
    for n, g in enumerate(fleet.groups, 1):
        rep = g.representative
        out.append(_clean({
            **{k: v for k, v in rep.items() if k not in ("path", "reason", "seconds")},
            **g.signature, "kind": "group", "group": g.id, "path": "", "count": g.count,
            "n_traces": len(g.traces), "representative": rep["path"],
            "time": g.first_time if math.isfinite(g.first_time) else math.nan,
            "rank_count": n, "rank_first": by_first[g.id],
            "apart": dumps(g.apart, indent=None),
            "report": reports.get(rep["path"], "")}))
    return out


def fleet_frame(fleet: Fleet, reports: dict[str, str] | None = None) -> Any:
    import pandas as pd

    return pd.DataFrame(fleet_rows(fleet, reports), columns=list(COLUMNS))


def write_parquet(fleet: Fleet, path: str | os.PathLike[str],
                  reports: dict[str, str] | None = None) -> str:
    try:
        import pyarrow  # noqa: F401
    except ImportError as exc:
        raise UsageError("the Parquet table needs pyarrow: pip install 'qforensics[fleet]'"
                         ) from exc
    df = fleet_frame(fleet, reports)
    try:
        with replacing(path) as tmp:
            df.to_parquet(tmp, engine="pyarrow", index=False)
    except OSError as exc:
        raise QForensicsError(f"{path}: cannot write the Parquet table ({exc}); choose "
                              "another -o directory") from exc
    return os.fspath(path)
