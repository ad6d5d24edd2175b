"""Fixtures for the triage tests: a small fleet written with TraceWriter (fleet_synth.py), the
unreadable files beside it, a dask scheduler and workers started as processes on free ports,
and headless Chromium (`browser`, tests/conftest.py's)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import fleet_synth  # noqa: E402


@pytest.fixture(scope="session")
def fleet_dir(tmp_path_factory):
    """(directory, specs, hostile kind -> path): 16 traces and 4 unreadable files."""
    d = tmp_path_factory.mktemp("fleet")
    specs = fleet_synth.small_fleet(str(d))
    bad = fleet_synth.hostile_files(str(d / "bad"))
    (d / "notes.txt").write_text("not a trace: a directory scan skips it")
    return d, specs, bad


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
    for p in reversed(procs):
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


class DaskProcesses:
    """`dask scheduler` and `dask worker` started as separate processes; stopped at the end."""

    def __init__(self, log_dir: Path) -> None:
        self.port = free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []
        self._spawn("scheduler", ["scheduler", "--host", "127.0.0.1", "--port",
                                  str(self.port), "--no-dashboard"])

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.log_dir / f"{name}-{len(self.procs)}.log", "wb")
        # `python -m dask scheduler` / `worker`: the `dask` command of this interpreter
        self.procs.append(subprocess.Popen([sys.executable, "-m", "dask", *args], stdout=log,
                                           stderr=subprocess.STDOUT, cwd=self.log_dir))

    def add_workers(self, n: int) -> None:
        for _ in range(n):
            self._spawn("worker", ["worker", self.address, "--nthreads", "1", "--nworkers",
                                   "1", "--no-dashboard", "--local-directory",
                                   str(self.log_dir)])

    def client(self, n_workers: int):
        from dask.distributed import Client

        deadline = time.monotonic() + 60
        while True:
            try:
                c = Client(self.address, timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
        c.wait_for_workers(n_workers, timeout=90)
        return c

    def stop(self) -> None:
        _stop(self.procs)


@pytest.fixture
def dask_processes(tmp_path):
    procs = DaskProcesses(tmp_path)
    try:
        yield procs
    finally:
        procs.stop()
