"""What `triage -o DIR` writes: `DIR/triage.parquet` (tables.py), `DIR/fleet.html` (html.py)
and `DIR/reports/group-NNN.html`, the representative trace's report of each incident group
(written as Dask tasks on the same cluster). No torch import.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qforensics.errors import QForensicsError
from qforensics.triage.groups import Fleet
from qforensics.triage.html import representative_reports, write_fleet_report
from qforensics.triage.tables import write_parquet

__all__ = ["Outputs", "write_outputs"]


@dataclass
class Outputs:
    parquet: Path
    html: Path
    reports: dict[str, str] = field(default_factory=dict)  # trace -> its report


def write_outputs(fleet: Fleet, out_dir: str | os.PathLike[str], *, client: Any = None,
                  reports: bool = True) -> Outputs:
    d = Path(out_dir)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise QForensicsError(f"{d}: cannot create the output directory ({exc})") from exc
    written = representative_reports(client, fleet, d / "reports") if reports else {}
    pq = Path(write_parquet(fleet, d / "triage.parquet", written))
    html = write_fleet_report(fleet, d / "fleet.html", written)
    return Outputs(pq, html, written)
