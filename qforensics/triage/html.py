"""The fleet report: one self-contained HTML page (no network, a CSP that admits only our own
script by hash) with the incident groups ranked by count (a button re-sorts them by first
time), what sets each apart, its representative's report, and the unreadable traces.

Trace content is untrusted: every value goes through Jinja2's autoescape; the one script is a
constant. The representatives' reports are `qforensics.reports.write_report`'s; the others are
one `qforensics report` command away (the page says which). No torch import.
"""

from __future__ import annotations

import datetime
import math
import os
from pathlib import Path
from typing import Any

import jinja2

from qforensics.atomic import write_text
from qforensics.errors import QForensicsError
from qforensics.reports.report import content_security_policy
from qforensics.triage.groups import Fleet, Group
from qforensics.version import __version__

__all__ = ["SORT_SCRIPT", "render_fleet", "write_fleet_report"]

SHOWN_TRACES = 50  # trace paths listed per group (the Parquet table has all)

# The page's only script: re-sort the group rows by count or by first time.
SORT_SCRIPT = (
    "(function(){"
    "var bar=document.getElementById('qf-sort');var body=document.getElementById('groups-body');"
    "if(!bar||!body){return;}bar.hidden=false;"
    "function by(key,desc){var rows=Array.prototype.slice.call(body.querySelectorAll('tr'));"
    "rows.sort(function(a,b){var x=+a.dataset[key],y=+b.dataset[key];"
    "return desc?(y-x)||(+a.dataset.group-+b.dataset.group):(x-y);});"
    "for(var i=0;i<rows.length;i++){body.appendChild(rows[i]);}}"
    "document.getElementById('sort-count').addEventListener('click',function(){by('count',true);});"
    "document.getElementById('sort-first').addEventListener('click',function(){by('first',false);});"
    "})();"
)

_EXIT_WORDS = {0: "every trace healthy", 1: "FAILED or SUSPECT traces found",
               2: "unreadable traces and nothing found", 3: "an internal error (a bug) on some "
               "trace"}


def _when(t: float) -> str:
    if not math.isfinite(t) or not 0 < t < 1e11:
        return "-"
    if t < 1e8:  # a monotonic clock, not wall time
        return f"t={t:.3f} s"
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S")


def _group_view(g: Group, rank_first: int, reports: dict[str, str], base: Path) -> dict:
    d = g.to_dict()
    rep = d["representative"]
    link = reports.get(rep, "")
    if link:
        try:
            link = Path(os.path.relpath(link, base)).as_posix()
        except ValueError:
            link = Path(link).resolve().as_uri()
    others = [p for p in d["traces"] if p != rep]
    return {**d, **g.signature, "status": g.status, "n_traces": len(d["traces"]),
            "rank_first": rank_first, "first_seen": _when(g.first_time), "report": link,
            "traces_shown": d["traces"][:SHOWN_TRACES],
            "traces_more": max(0, len(d["traces"]) - SHOWN_TRACES),
            "command": f"qforensics report {others[0] if others else rep} -o incident.html"}


def render_fleet(fleet: Fleet, *, reports: dict[str, str] | None = None,
                 base: str | os.PathLike[str] = ".") -> str:
    """The page's HTML. `reports`: trace path -> its written report (linked relative to
    `base`, the page's folder)."""
    env = jinja2.Environment(loader=jinja2.PackageLoader("qforensics.triage", "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True)
    first = {g.id: n for n, g in enumerate(fleet.by_first_time, 1)}
    reports = reports or {}
    groups = [_group_view(g, first[g.id], reports, Path(base)) for g in fleet.groups]
    return env.get_template("fleet.html.j2").render(
        csp=content_security_policy(SORT_SCRIPT), script=jinja2.utils.markupsafe.Markup(
            SORT_SCRIPT), version=__version__, n_traces=len(fleet.rows),
        n_healthy=sum(len(i.rows) for i in fleet.healthy), groups=groups,
        unreadable=fleet.unreadable, exit_code=fleet.exit_code,
        exit_words=_EXIT_WORDS.get(fleet.exit_code, ""),
        generated=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))


def write_fleet_report(fleet: Fleet, path: str | os.PathLike[str],
                       reports: dict[str, str] | None = None) -> Path:
    out = Path(path)
    html = render_fleet(fleet, reports=reports, base=out.parent)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_text(out, html)
    except OSError as exc:
        raise QForensicsError(f"{out}: cannot write the fleet report ({exc}); choose another "
                              "-o directory") from exc
    return out


def representative_reports(client: Any, fleet: Fleet, folder: str | os.PathLike[str]
                           ) -> dict[str, str]:
    """Write each group's representative report into `folder` (one Dask task each, or in
    this process without a client). Returns trace path -> report path; a report that
    cannot be written is left out (the page then shows the command instead)."""
    folder = Path(folder)
    jobs = {g.representative["path"]: str(folder / f"group-{g.id:03d}.html")
            for g in fleet.groups}
    if not jobs:
        return {}
    if client is None:
        return {t: o for t, o in jobs.items() if _write_one(t, o)}
    futs = client.map(_write_one, list(jobs), list(jobs.values()), pure=False)
    done = []
    for f in futs:
        try:
            done.append(bool(f.result()))
        except Exception:  # noqa: BLE001 - a lost worker: the page shows the command instead
            done.append(False)
    return {t: o for (t, o), ok in zip(jobs.items(), done) if ok}


def _write_one(trace: str, out: str) -> bool:
    from qforensics.reports import write_report

    try:
        write_report(trace, out)
    except Exception:  # noqa: BLE001 - unreadable, or a report bug: the page shows the command
        return False
    return True
