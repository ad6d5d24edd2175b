"""The served incident, long: vLLM's OpenAI-compatible server under `qforensics record` with a
byte budget, healthy client traffic for --minutes, poisoned requests from --trigger-minute on,
then kill -9 of the server's process group; prints the trace's size over time, then analyze's
verdict on what was left behind.

    .venv-vllm/bin/python bench/served_incident.py                  # 12 min, compiled mode
    .venv-vllm/bin/python bench/served_incident.py --minutes 3 --trigger-minute 2 --eager

The checkpoint and the traffic: qforensics/demo/vllm_incident.py. The same incident, short, is
tests/engines/test_vllm_incident.py.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from qforensics.demo import vllm_incident as vi


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=12.0, help="client traffic in all")
    ap.add_argument("--trigger-minute", type=float, default=10.0,
                    help="when the first poisoned request goes out")
    ap.add_argument("--budget-mib", type=float, default=128.0)
    ap.add_argument("--eager", action="store_true", help="enforce_eager (default: compiled)")
    ap.add_argument("--stop", choices=("kill", "term"), default="kill")
    ap.add_argument("--keep", help="keep the trace and logs in this folder")
    a = ap.parse_args()
    from qforensics.demo.vllm_model import vllm_model_dir
    from qforensics.demo.vllm_scenarios import serve_env

    work = Path(a.keep or tempfile.mkdtemp(prefix="qf-incident-"))
    work.mkdir(parents=True, exist_ok=True)
    tok = vi.incident_checkpoint(vllm_model_dir(), work / "model")
    port = vi.free_port()
    trace = work / "s-0.h5"
    cmd = vi.server_command(work / "model", str(work / "s-{rank}.h5"), port,
                            compiled=not a.eager, max_bytes_mib=a.budget_mib)
    print(f"model: {work / 'model'} (embedding row {tok} NaN, lm_head untied); "
          f"{'eager' if a.eager else 'compiled'}; budget {a.budget_mib:g} MiB", flush=True)
    proc = vi.start_server(cmd, serve_env(), work, work / "server.log")
    sizes: list[tuple[float, int]] = []
    done = threading.Event()
    try:
        up = vi.wait_ready(proc, port, 1800, work / "server.log")
        print(f"server up after {up:.0f} s", flush=True)
        t0 = time.time()

        def sample() -> None:
            while not done.wait(30):
                n = trace.stat().st_size if trace.exists() else 0
                sizes.append((time.time() - t0, n))
                print(f"  t={sizes[-1][0] / 60:5.1f} min  trace {n / 2**20:7.1f} MiB", flush=True)

        threading.Thread(target=sample, daemon=True).start()
        traffic = vi.Traffic(port, a.minutes * 60, a.trigger_minute * 60, poisoned=3,
                             poison_gap=20)
        sent = traffic.run()
    finally:
        done.set()
        vi.stop(proc, signal.SIGKILL if a.stop == "kill" else signal.SIGTERM)
    ok = [s for s in sent if not s.error]
    print(f"requests: {len(sent)} sent, {len(ok)} answered, "
          f"{sum(s.completion_tokens for s in ok)} tokens generated; "
          f"{sum(s.poisoned for s in sent)} poisoned", flush=True)
    final = trace.stat().st_size
    steady = [(t, n) for t, n in sizes if t > 60]
    if len(steady) >= 2:
        rate = (steady[-1][1] - steady[0][1]) / max(steady[-1][0] - steady[0][0], 1)
        print(f"trace growth over the last samples: {rate / 1024:.1f} KiB/s")
    print(f"trace after the stop: {final / 2**20:.1f} MiB of a {a.budget_mib:g} MiB budget "
          f"({'within' if final <= a.budget_mib * 2**20 else 'OVER'})")
    r = subprocess.run([sys.executable, "-m", "qforensics.cli", "analyze", str(trace), "--json"],
                       capture_output=True, text=True, check=False)
    print(f"analyze exit {r.returncode}")
    try:
        doc = json.loads(r.stdout)
        print(json.dumps({k: doc.get(k) for k in ("status", "summary", "first_nonfinite",
                                                   "coverage")}, indent=1)[:3000])
    except ValueError:
        print(r.stdout[-3000:], r.stderr[-2000:])
    if not a.keep:
        print(f"(work folder {work}; pass --keep DIR to keep it elsewhere)")
    return 0 if os.path.exists(trace) else 1


if __name__ == "__main__":
    raise SystemExit(main())
