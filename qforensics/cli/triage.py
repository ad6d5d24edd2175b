"""`qforensics triage PATHS... [-o DIR] [--json [PATH]]`: many traces -> incident groups, on Dask
(printing, progress and exit codes only; the work lives in qforensics.triage). No torch import.
"""

from __future__ import annotations

import sys

import click

from qforensics.cli.jsonout import JsonCommand, json_option, json_out
from qforensics.cli.text import wrap
from qforensics.triage.groups import Fleet


EXAMPLE = """\b
Example:
    qforensics triage /var/traces/ -o triage-out
    qforensics triage 'fleet/**/*.h5' --json > triage.json
    qforensics triage /var/traces/ --json triage.json --quiet
    dask scheduler --port 8786 &  dask worker tcp://127.0.0.1:8786 &
    qforensics triage fleet/ --scheduler tcp://127.0.0.1:8786 -o triage-out
"""


class _Count:
    """A count on stderr: in place on a terminal, else a line every tenth of the run."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last = -1

    def __call__(self, done: int, total: int) -> None:
        step = max(1, total // 10)
        if self.tty:
            click.echo(f"\rtriage: {done}/{total} traces", err=True, nl=done == total)
        elif done == total or done // step != self.last:
            self.last = done // step
            click.echo(f"triage: {done}/{total} traces", err=True)


def render(fleet: Fleet) -> list[str]:
    n_h = sum(len(i.rows) for i in fleet.healthy)
    n_g = sum(len(g.traces) for g in fleet.groups)
    head = "FAILED" if any(g.status == "FAILED" for g in fleet.groups) else (
        "SUSPECT" if fleet.groups else ("PASSED" if not fleet.unreadable else "UNREADABLE"))
    L = [f"{head} | {len(fleet.rows)} traces: {n_h} healthy, {n_g} in {len(fleet.groups)} "
         f"incident groups, {len(fleet.unreadable)} unreadable"]
    for g in fleet.groups:
        s, rep = g.signature, g.representative
        L += ["", f"#{g.id} {g.status} x{g.count} ({len(g.traces)} traces): "
              f"{s['producer'] or '-'}"]
        L.append(wrap(f"cause: {g.cause_text or '-'}; layer: {s['method'] or '-'} / "
                      f"{s['kernel'] or '-'}; {s['engine']} {s['engine_version']}, torch "
                      f"{s['torch']}; model {s['model']}", "   ", "     "))
        if g.apart:
            L.append(wrap("apart: " + "; ".join(
                f"{a['attribute']} {a['value']} ({a['affected']}/{a['of_affected']} affected"
                + (f", {a['healthy']}/{a['of_healthy']} healthy)" if a["healthy"] is not None
                   else ")") for a in g.apart), "   ", "     "))
        L.append(wrap(f"first: {rep['path']} (rank {rep['rank']})", "   ", "     "))
    if fleet.unreadable:
        L += ["", "Unreadable"]
        for u in fleet.unreadable:
            why = u["reason"]  # the reader's reasons begin with the path: said once
            why = why[len(u["path"]) + 2:] if why.startswith(f"{u['path']}: ") else why
            L.append(wrap(f"{u['path']}: {'internal error: ' if u.get('internal') else ''}"
                          f"{why}", "  ", "    "))
    return L


@click.command("triage", cls=JsonCommand, epilog=EXAMPLE)
@click.argument("paths", nargs=-1, required=True)
@click.option("-o", "--output", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Write DIR/triage.parquet (one row per trace and per group), DIR/fleet.html "
                   "and the representatives' reports in DIR/reports/.")
@json_option("{traces, groups: [{verdict, producer, cause, count, traces}], unreadable: "
             "[{path, reason}]} (schema qforensics.triage, docs/triage.md)")
@click.option("--scheduler", default=None, metavar="tcp://HOST:PORT",
              help="Run on this dask.distributed scheduler instead of a local cluster.")
@click.option("--workers", type=click.IntRange(1, 1024), default=None,
              help="Worker processes of the local cluster [default: the CPU count].")
@click.option("--no-reports", is_flag=True, help="With -o: skip the representatives' reports.")
@click.option("--quiet", is_flag=True, help="No progress count on stderr.")
def command(paths: tuple[str, ...], out_dir: str | None, json_path: str | None,
            scheduler: str | None, workers: int | None, no_reports: bool, quiet: bool) -> None:
    """Triage a fleet: analyze every trace in PATHS (files, globs, directories read
    recursively), one Dask task per trace, and group the incidents by signature (verdict,
    producer, cause and its index, the layer's quantization and kernel, engine and torch
    versions, model). The ranks of one run are one incident, named by the rank that failed
    first. Unreadable traces are listed with the reason and never stop the run.

    By default Dask runs a local cluster of worker processes here (nothing to start);
    --scheduler uses an existing cluster. Torch is not needed.

    Exit status: 0 all healthy, 1 FAILED or SUSPECT groups, 2 bad usage, or unreadable traces
    and nothing found, 3 internal error (also when any trace met one).
    """
    from qforensics.triage.groups import build_fleet
    from qforensics.triage.outputs import write_outputs
    from qforensics.triage.run import collect_traces, dask_client, run_tasks

    found = collect_traces(paths)
    out = json_out(json_path, found)
    progress = None if quiet else _Count()
    with dask_client(scheduler, workers) as client:
        fleet = build_fleet(run_tasks(client, found, progress))
        outputs = (write_outputs(fleet, out_dir, client=client, reports=not no_reports)
                   if out_dir is not None else None)
    out.text("\n".join(render(fleet)))
    if outputs is not None:
        out.text("")
        out.note(f"wrote {outputs.parquet}, {outputs.html} and {len(outputs.reports)} "
                 "representative reports")
    out.write(fleet.to_dict())
    click.get_current_context().exit(fleet.exit_code)
