"""Triage on a cluster started as separate processes (`dask scheduler`, `dask worker`), as users
run it; and a worker killed mid-run: Dask reschedules its tasks and every trace is still
analyzed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import fleet_synth
from expected import expected_groups

from qforensics.triage import triage_traces


def test_cli_on_an_external_scheduler(fleet_dir, dask_processes):
    d, specs, bad = fleet_dir
    dask_processes.add_workers(2)
    dask_processes.client(2).close()  # both workers up
    res = subprocess.run([sys.executable, "-m", "qforensics.cli", "triage", str(d), "--json",
                          "--scheduler", dask_processes.address], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 1, res.stderr[-2000:]
    doc = json.loads(res.stdout)
    assert doc["traces"] == len(specs) + len(bad)
    want = expected_groups(specs)
    assert [(g["count"], sorted(g["traces"])) for g in doc["groups"]] == [
        (w["count"], w["traces"]) for w in want]
    assert sorted(u["path"] for u in doc["unreadable"]) == sorted(bad.values())
    assert "triage: " in res.stderr and f"{len(specs) + len(bad)}/" in res.stderr  # progress


def test_a_worker_killed_mid_run_is_retried(tmp_path, dask_processes):
    specs = [fleet_synth.Spec(str(tmp_path / f"t{i:03d}.h5"), shape="qwen2.5-0.5b-4l",
                              incident="weight_nan" if i % 5 == 0 else None, layer=1, row=9,
                              seed=i, steps=2, t0=1.79e9 + i) for i in range(60)]
    for s in specs:
        fleet_synth.write_trace(s)
    dask_processes.add_workers(2)
    client = dask_processes.client(2)
    try:
        pids = sorted(client.run(os.getpid).values())
        killed: list[int] = []

        def progress(done: int, total: int) -> None:
            if done >= 5 and not killed:  # mid-run: a worker process dies without a word
                os.kill(pids[0], signal.SIGKILL)
                killed.append(pids[0])

        fleet = triage_traces([str(tmp_path)], client=client, progress=progress)
    finally:
        client.close()
    assert killed
    assert fleet.unreadable == []
    assert len(fleet.rows) == len(specs)
    bad = sorted(s.path for s in specs if s.incident)
    assert [sorted(g.traces) for g in fleet.groups] == [bad]
    assert sum(len(i.rows) for i in fleet.healthy) == len(specs) - len(bad)
