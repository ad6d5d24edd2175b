"""Triage a fleet of 1,000+ traces: with the embedded local cluster, and on a cluster started as
separate processes (`dask scheduler`, then `dask worker` x 1 and x 2 on localhost).

    python bench/triage_fleet.py                 # writes the fleet once into /tmp (~1.5 GB)
    python bench/triage_fleet.py --traces 2000 --regenerate --dir /data/fleet
    python bench/triage_fleet.py --tiny --dir DIR   # CI (tests/bench): 30 traces, seconds

The fleet (written once, as Dask tasks, then reused):
  - the committed real captures of SmolLM2-135M (sample_traces/, ten scenarios) copied onto
    four replicas each (their environment's host rewritten with the trace writer's set_meta);
  - synthetic traces written with TraceWriter (tests/triage/fleet_synth.py) in three model
    shapes, HF and vLLM (fused qkv/gate_up) naming, with incidents across replicas and ranks:
    a weight NaN on one HF checkpoint, FP8 activation outliers on vLLM 0.11.1 with long prompts,
    a NaN weight_scale on rank 0 of TP=2 vLLM runs, float16 overflow under torch 2.9, an
    unhooked op, all-zero weights; the rest healthy;
  - unreadable files: garbage, empty, cut short, an HDF5 external link.
Each run is the `qforensics triage` command in a fresh process, timed from start to exit; the
groups it prints are checked against the incidents as built. Prints traces per second and the
speed-up from one worker to two.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "triage"))

import fleet_synth  # noqa: E402
from fleet_synth import Spec  # noqa: E402

from qforensics.trace.reader import open_trace  # noqa: E402
from qforensics.trace.writer import set_meta  # noqa: E402

SAMPLES = REPO / "sample_traces"
REAL_REPLICAS = 4
T0 = 1.79e9


def plan(d: Path, n: int, per_kind: int | None = None) -> list[Spec]:
    """The synthetic traces: incidents (what triage must find) and healthy runs; `per_kind`
    caps the traces (TP: runs) of each incident kind."""
    rng = np.random.default_rng(28)

    def count(full: int) -> int:
        return full if per_kind is None else min(full, per_kind)

    shapes = list(fleet_synth.SHAPES)
    out: list[Spec] = []

    def add(name: str, **kw) -> None:
        kw.setdefault("seed", len(out))
        kw.setdefault("steps", 4)
        kw.setdefault("host", f"replica-{len(out) % 64}")
        out.append(Spec(str(d / "synthetic" / name), **kw))

    for i in range(count(24)):  # one bad HF checkpoint, served on 24 replicas
        add(f"hf-ckpt7-{i}.h5", incident="weight_nan", layer=3, row=100, model="/models/ckpt7",
            t0=T0 + 3600 + 60 * i)
    for i in range(count(40)):  # FP8 activations blow up on long prompts under vLLM 0.11.1
        add(f"vllm-fp8-{i}.h5", engine="vllm", version="0.11.1", incident="fp8_outlier",
            layer=5, channel=1234, prompt=int(rng.integers(600, 2000)), t0=T0 + 7200 + 30 * i)
    for i in range(count(15)):  # TP=2 runs: rank 0 loaded a NaN weight_scale
        for r in range(2):
            add(f"tp/run{i:02d}-{r}.h5", engine="vllm", version="0.11.0",
                incident="scale_nan", layer=4, row=33, world=2, rank=r, host=f"tp-node-{i}",
                t0=T0 + 1800 + 40 * i)
    for i in range(count(20)):  # float16 overflow after the torch 2.9 upgrade
        add(f"hf-fp16-{i}.h5", incident="fp16_overflow", layer=2, torch="2.9.0+cu128",
            t0=T0 + 9000 + 20 * i)
    for i in range(count(12)):
        add(f"hf-gap-{i}.h5", incident="gap", layer=6, t0=T0 + 500 + 10 * i,
            shape="llama-160m")
    for i in range(count(10)):
        add(f"hf-zero-{i}.h5", incident="zero_weights", layer=8, model="/models/int4-rtn",
            t0=T0 + 12000 + 10 * i)
    i = 0
    while len(out) < n:
        vllm = i % 3 == 0
        add(f"healthy/ok-{i:04d}.h5", engine="vllm" if vllm else "hf",
            version=("0.11.0" if i % 2 else "0.11.1") if vllm else "4.57.1",
            shape=shapes[i % len(shapes)], prompt=int(rng.integers(8, 500)),
            t0=T0 + float(rng.integers(0, 14000)))
        i += 1
    return out


def write_fleet(d: Path, n_synthetic: int, per_kind: int | None = None,
                replicas: int = REAL_REPLICAS) -> list[Spec]:
    from dask.distributed import Client, LocalCluster, progress  # noqa: F401

    if d.exists():
        shutil.rmtree(d)
    specs = plan(d, n_synthetic, per_kind)
    for s in specs:
        Path(s.path).parent.mkdir(parents=True, exist_ok=True)
    real = d / "real"
    real.mkdir(parents=True)
    for p in sorted(SAMPLES.glob("*.h5")):
        with open_trace(p) as t:
            env = dict(t.meta["environment"])
        for r in range(replicas):
            dst = real / f"{p.stem}-replica{r}.h5"
            shutil.copyfile(p, dst)
            set_meta(dst, "environment", {**env, "host": f"smol-replica-{r}"})
    fleet_synth.hostile_files(str(d / "corrupt"))
    t = time.perf_counter()
    with LocalCluster(n_workers=os.cpu_count(), threads_per_worker=1,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        client.gather(client.map(fleet_synth.write_trace, specs, pure=False))
    print(f"wrote {len(specs)} synthetic traces in {time.perf_counter() - t:.0f} s", flush=True)
    (d / "plan.json").write_text(json.dumps([s.__dict__ for s in specs]))
    return specs


def load_plan(d: Path) -> list[Spec]:
    return [Spec(**kw) for kw in json.loads((d / "plan.json").read_text())]


def expected(specs: list[Spec]) -> dict[tuple, int]:
    """(producer, cause words) -> incidents, from how the traces were built."""
    out: dict[tuple, int] = {}
    for s in specs:
        if s.incident is None or s.rank != 0:
            continue
        e = fleet_synth.expect(s)
        cause = e["cause"] + (f" ({e['cause_index']})" if e.get("cause_index") else "")
        key = (e.get("producer"), cause)
        out[key] = out.get(key, 0) + 1
    return out


def triage(d: Path, out: Path, extra: list[str]) -> tuple[float, dict, int, float]:
    """Run the command; (wall s, its JSON, exit code, CPU s of it and the processes it
    waited for: with the local cluster, its workers)."""
    cmd = [sys.executable, "-m", "qforensics.cli", "triage", str(d), "--json", "--quiet",
           "-o", str(out), *extra]
    out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    with open(out / "stdout.json", "wb") as so, open(out / "stderr.txt", "wb") as se:
        p = subprocess.Popen(cmd, stdout=so, stderr=se)
        _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    rc = os.waitstatus_to_exitcode(status)
    if rc not in (0, 1, 2):
        raise SystemExit(f"triage failed ({rc}): {(out / 'stderr.txt').read_text()[-3000:]}")
    return wall, json.loads((out / "stdout.json").read_text()), rc, ru.ru_utime + ru.ru_stime


def load() -> str:
    return "load average %.1f %.1f %.1f" % os.getloadavg()


def worker_cpu(addr: str) -> float:
    from dask.distributed import Client

    with Client(addr, timeout=10) as c:
        return sum(c.run(lambda: sum(__import__("resource").getrusage(0)[:2])).values())


def check(doc: dict, specs: list[Spec], real_groups: int) -> str:
    want = expected(specs)
    got = {(g["producer"] or None, g["cause"]): g["count"] for g in doc["groups"]}
    missing = {k: v for k, v in want.items() if k[0] is not None and got.get(k) != v}
    zero = [g for g in doc["groups"] if g["cause"] == "parameters_mostly_zero"
            and any("/synthetic/" in p for p in g["traces"])]
    ok = not missing and sum(g["count"] for g in zero) == want.get(
        (None, "parameters_mostly_zero"), 0)
    n_real = len([g for g in doc["groups"] if all("/real/" in p for p in g["traces"])])
    return (f"groups as built: {'yes' if ok else 'NO ' + repr(missing)}; "
            f"{len(doc['groups'])} groups ({n_real} of the real captures, expected "
            f"{real_groups}), {len(doc['unreadable'])} unreadable")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def on_processes(d: Path, out: Path, n_workers: int, logs: Path
                 ) -> tuple[float, dict, int, float]:
    """`dask scheduler` and `dask worker` x n as separate processes, then the command."""
    port = free_port()
    addr = f"tcp://127.0.0.1:{port}"
    procs = []
    logs.mkdir(parents=True, exist_ok=True)
    try:
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "dask", "scheduler", "--host", "127.0.0.1", "--port",
             str(port), "--no-dashboard"], stdout=open(logs / "scheduler.log", "wb"),
            stderr=subprocess.STDOUT))
        for i in range(n_workers):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "dask", "worker", addr, "--nthreads", "1",
                 "--no-dashboard", "--local-directory", str(logs)],
                stdout=open(logs / f"worker-{i}.log", "wb"), stderr=subprocess.STDOUT))
        from dask.distributed import Client

        deadline = time.monotonic() + 120
        while True:
            try:
                with Client(addr, timeout=5) as c:
                    c.wait_for_workers(n_workers, timeout=120)
                    c.run(lambda: __import__("qforensics.triage.summary"))  # warm, like a
                break  # long-running cluster
            except OSError:
                if time.monotonic() > deadline:
                    raise
        before = worker_cpu(addr)
        wall, doc, rc, cpu_cmd = triage(d, out, ["--scheduler", addr])
        return wall, doc, rc, cpu_cmd + worker_cpu(addr) - before
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next(ln.split(":", 1)[1].strip() for ln in out.splitlines()
                    if ln.startswith("Model name"))
    except (OSError, StopIteration):
        name = "unknown CPU"
    return f"{name}, {os.cpu_count()} cores"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", type=int, default=1000, help="synthetic traces [1000]")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/qforensics-fleet-bench"))
    ap.add_argument("--regenerate", action="store_true")
    ap.add_argument("--skip", choices=["local", "processes"], action="append", default=[])
    ap.add_argument("--tiny", action="store_true",
                    help="30 traces (2 of each incident kind, 1 copy of each sample), rewritten "
                         "each run: the benchmark's CI mode (tests/bench)")
    a = ap.parse_args()
    per_kind, replicas = (2, 1) if a.tiny else (None, REAL_REPLICAS)
    if a.tiny:
        a.traces, a.regenerate = 30, True
    if a.regenerate or not (a.dir / "plan.json").is_file():
        specs = write_fleet(a.dir, a.traces - len(list(SAMPLES.glob("*.h5"))) * replicas,
                            per_kind, replicas)
    else:
        specs = load_plan(a.dir)
    n = sum(1 for _ in a.dir.rglob("*.h5"))
    size = sum(p.stat().st_size for p in a.dir.rglob("*.h5")) / 1e9
    print(f"fleet: {n} trace files ({size:.2f} GB) in {a.dir}; CPU: {cpu()}", flush=True)
    real_groups = 6  # the committed samples: 2 FAILED + 4 SUSPECT scenarios
    out = Path(str(a.dir) + "-out")
    def say(what: str, wall: float, doc: dict, rc: int, cpu_s: float) -> None:
        print(f"{what}: {doc['traces']} traces in {wall:.1f} s = {doc['traces'] / wall:.1f} "
              f"traces/s, exit {rc}; CPU {cpu_s:.0f} s ({1000 * cpu_s / doc['traces']:.0f} ms "
              f"a trace, all processes); {load()}; {check(doc, specs, real_groups)}",
              flush=True)

    if "local" not in a.skip:
        wall, doc, rc, cpu_s = triage(a.dir, out / "local", [])
        say(f"local cluster (default, {os.cpu_count()} workers)", wall, doc, rc, cpu_s)
    if "processes" not in a.skip:
        walls = {}
        for k in (1, 2):
            wall, doc, rc, cpu_s = on_processes(a.dir, out / f"w{k}", k, out / f"logs-{k}")
            walls[k] = wall
            say(f"dask scheduler + {k} dask worker process(es)", wall, doc, rc, cpu_s)
        print(f"speed-up 1 -> 2 workers: {walls[1] / walls[2]:.2f}x")


if __name__ == "__main__":
    main()
