"""Time `qforensics report` on the sample traces (not a test: prints seconds).

    python bench/report_speed.py [TRACE ...]        # default: sample_traces/*.h5

For each trace: seconds for `write_report` in this process (imports already paid), and the
wall time of a fresh `qforensics report` process (imports included). The target is at most 2 s
per sample trace.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv] or sorted((ROOT / "sample_traces").glob("*.h5"))
    if not paths:
        print("no traces: pass paths, or add sample_traces/*.h5", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    from qforensics.reports import write_report

    print(f"import qforensics.reports: {time.perf_counter() - t0:.2f} s")
    worst = worst_cpu = 0.0
    with tempfile.TemporaryDirectory() as d:
        for p in paths:
            out = Path(d) / (p.stem + ".html")
            r = write_report(p, out)
            cli, proc, cpu = _cli(p, out)
            worst, worst_cpu = max(worst, cli), max(worst_cpu, cpu)
            status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
            print(f"{p.name:32s} write_report {r.seconds:5.2f} s   cli {cli:5.2f} s "
                  f"(cpu {cpu:4.2f} s)   {r.bytes / 1024:6.0f} KiB   {r.verdict.status:8s} "
                  f"{status}")
    print(f"slowest cli run: {worst:.2f} s (target <= 2 s); largest CPU time (user + sys) of a "
          f"cli run {worst_cpu:.2f} s; load average {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} CPUs")
    if sys.flags.dont_write_bytecode:
        print("(PYTHONDONTWRITEBYTECODE is set: qforensics' modules were compiled from source in "
              "each run, as an installed package's are not)")
    return 0


def _cli(trace: Path, out: Path) -> tuple[float, subprocess.CompletedProcess, float]:
    """(wall seconds, the process, its CPU seconds: user + system; the wall time also counts
    waiting for a CPU when the machine is shared)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    c0 = ru.ru_utime + ru.ru_stime
    t1 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", "from qforensics.cli import main; main()",
                           "report", str(trace), "-o", str(out)], capture_output=True, text=True,
                          check=False)
    wall = time.perf_counter() - t1
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, proc, ru.ru_utime + ru.ru_stime - c0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
