"""The fleet on Dask: one task per trace, on a local cluster of processes or an existing one.

`triage_traces(paths)` starts an embedded `LocalCluster` (one single-threaded worker process
per CPU core, no dashboard) unless `scheduler` names a running dask.distributed scheduler
(`tcp://HOST:PORT`). Every trace is one `summarize_trace` task (`client.map`, `pure=False`),
each returning a small dict. Dask reschedules the tasks of a worker that dies; a trace that
kills `distributed.scheduler.allowed-failures` + 1 workers in turn comes back as Dask's
`KilledWorker` and is listed as unreadable with that reason, and the run goes on. Progress is
reported through the `progress(done, total)` callback (the CLI prints it). No home-made pool;
never prints; no torch import.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from qforensics.errors import UsageError
from qforensics.triage.groups import Fleet, build_fleet
from qforensics.triage.summary import summarize_trace, unreadable_row

__all__ = ["TRACE_SUFFIXES", "collect_traces", "dask_client", "triage_traces"]

TRACE_SUFFIXES = (".h5", ".hdf5")
Progress = Callable[[int, int], None]


def collect_traces(paths: Iterable[str]) -> list[str]:
    """Files as given, globs expanded (quoted ones too), directories read recursively for
    `*.h5` / `*.hdf5` files; duplicates dropped, order kept. A path or glob that matches
    nothing is a usage error."""
    out: list[str] = []
    for p in paths:
        p = os.fspath(p)
        if os.path.isdir(p):
            found = sorted(os.path.join(d, n) for d, _, names in os.walk(p) for n in names
                           if n.lower().endswith(TRACE_SUFFIXES))
            if not found:
                raise UsageError(f"{p}: no trace (*.h5, *.hdf5) in this directory or below")
            out.extend(found)
        elif os.path.lexists(p):
            out.append(p)
        elif any(c in p for c in "*?["):
            hits = sorted(h for h in glob.glob(p, recursive=True) if not os.path.isdir(h))
            if not hits:
                raise UsageError(f"no trace matches {p!r}")
            out.extend(hits)
        else:
            raise UsageError(f"{p}: no such file or directory")
    return list(dict.fromkeys(out))


@contextmanager
def dask_client(scheduler: str | None = None, workers: int | None = None,
                timeout: float = 30.0) -> Iterator[Any]:
    """A dask.distributed Client: on `scheduler`, else on an embedded LocalCluster of
    `workers` (default: the CPU count) single-threaded processes, closed afterwards."""
    try:
        from dask.distributed import Client, LocalCluster
    except ImportError as exc:
        raise UsageError("triage runs on Dask: pip install 'qforensics[fleet]' (dask, "
                         f"distributed, pyarrow); {exc}") from exc
    if scheduler is not None:
        try:
            client = Client(scheduler, timeout=timeout)
        except (OSError, TimeoutError) as exc:
            raise UsageError(f"cannot reach the Dask scheduler {scheduler}: {exc}; start it "
                             "with `dask scheduler` and workers with `dask worker ADDRESS`"
                             ) from exc
        try:
            yield client
        finally:
            client.close()
        return
    n = workers or os.cpu_count() or 1
    cluster = LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                           dashboard_address=None, silence_logs=logging.ERROR)
    try:
        with Client(cluster) as client:
            yield client
    finally:
        cluster.close()


def run_tasks(client: Any, paths: list[str], progress: Progress | None = None,
              retries: int = 1) -> list[dict[str, Any]]:
    """One `summarize_trace` task per path on `client`; rows in completion order."""
    from dask.distributed import as_completed

    futures = client.map(summarize_trace, paths, pure=False, retries=retries,
                         key=[f"qforensics-triage-{i}" for i in range(len(paths))])
    where = {f.key: p for f, p in zip(futures, paths)}
    rows: list[dict[str, Any]] = []
    total = len(paths)
    if progress is not None:
        progress(0, total)
    for fut in as_completed(futures):
        path = where[fut.key]
        try:
            row = fut.result()
        except Exception as exc:  # noqa: BLE001 - KilledWorker, a lost worker, a bug
            name = type(exc).__name__
            if name == "KilledWorker":
                row = unreadable_row(path, "the Dask workers analyzing this trace died "
                                     f"(Dask gave up on it: {exc}); it may crash the "
                                     "reader: check it alone with `qforensics analyze`")
            else:
                row = unreadable_row(path, f"task failed ({name}: {exc})", internal=True)
        fut.release()
        rows.append(row)
        if progress is not None:
            progress(len(rows), total)
    return rows


def triage_traces(paths: Iterable[str], *, scheduler: str | None = None,
                  workers: int | None = None, progress: Progress | None = None,
                  client: Any = None) -> Fleet:
    """Triage every trace under `paths` (files, globs, directories) on Dask and group them.
    `client`: an already connected dask.distributed Client (then `scheduler` and `workers`
    are not used)."""
    found = collect_traces(paths)
    if not found:
        raise UsageError("no trace given")
    if client is not None:
        return build_fleet(run_tasks(client, found, progress))
    with dask_client(scheduler, workers) as c:
        return build_fleet(run_tasks(c, found, progress))
