"""Time `qforensics report` on the sample traces (not a test: prints seconds).

    python bench/report_speed.py [TRACE ...]        # default: sample_traces/*.h5

For each trace: seconds for `write_report` in this process (imports already paid), and the
wall time of a fresh `qforensics report` process (imports included). The target is at most 2 s
per sample trace. The compiled report template is cached after the first report (in
$QFORENSICS_CACHE_DIR, else $XDG_CACHE_HOME/qforensics or ~/.cache/qforensics, /templates), so
the first trace is also timed once with an empty cache.
"""

from __future__ import annotations

import os
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
        cold = _cli(paths[0], Path(d) / "cold.html", {"QFORENSICS_CACHE_DIR": str(Path(d) / "c")})
        print(f"{paths[0].name:32s} cli with an empty template cache {cold[0]:5.2f} s "
              f"(exit {cold[1].returncode})")
        for p in paths:
            out = Path(d) / (p.stem + ".html")
            r = write_report(p, out)
            cli, proc = _cli(p, out)
            worst = max(worst, cli)
            status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
            print(f"{p.name:32s} write_report {r.seconds:5.2f} s   cli {cli:5.2f} s   "
                  f"{r.bytes / 1024:6.0f} KiB   {r.verdict.status:8s} {status}")
    print(f"slowest cli run: {worst:.2f} s (target <= 2 s)")
    if sys.flags.dont_write_bytecode:
        print("(PYTHONDONTWRITEBYTECODE is set: qforensics' modules were compiled from source in "
              "each run, as an installed package's are not)")
    return 0


def _cli(trace: Path, out: Path, env: dict[str, str] | None = None
         ) -> tuple[float, subprocess.CompletedProcess]:
    t1 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", "from qforensics.cli import main; main()",
                           "report", str(trace), "-o", str(out)], capture_output=True, text=True,
                          check=False, env={**os.environ, **(env or {})})
    return time.perf_counter() - t1, proc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
