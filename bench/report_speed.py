"""Time `qforensics report` on the sample traces (not a test: prints seconds).

    python bench/report_speed.py [TRACE ...]        # default: sample_traces/*.h5

For each trace: seconds for `write_report` in this process (imports already paid), and the
wall time of a fresh `qforensics report` process (imports included). The target is at most 5 s
per sample trace.
"""

from __future__ import annotations

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
    worst = 0.0
    with tempfile.TemporaryDirectory() as d:
        for p in paths:
            out = Path(d) / (p.stem + ".html")
            r = write_report(p, out)
            t1 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-c", "from qforensics.cli import main; main()",
                                   "report", str(p), "-o", str(out)],
                                  capture_output=True, text=True, check=False)
            cli = time.perf_counter() - t1
            worst = max(worst, cli)
            status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
            print(f"{p.name:32s} write_report {r.seconds:5.2f} s   cli {cli:5.2f} s   "
                  f"{r.bytes / 1024:6.0f} KiB   {r.verdict.status:8s} {status}")
    print(f"slowest cli run: {worst:.2f} s (target <= 5 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
