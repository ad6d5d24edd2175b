"""Build the native kernels at install time: `python -m qforensics.hooks.prebuild`.

hooks/fused_reduce.c (the CPU stats op's one-pass kernel and the logits' figures),
hooks/opcall.c (the stats op's eager CPU calls without the dispatcher) and hooks/statsop_cpu.cpp (the stats op's C++
kernel, against this torch's headers: hooks/statsnative.py) are compiled into the
kernel cache (hooks/fused.py `build`: keyed by source, flags and CPU, loaded only from a folder
nobody else can write). A run then loads them on its first step instead of compiling them in a
background thread while its first steps take the slower numpy path; a run on a machine where
they were not built still builds them itself. scripts/install.sh runs this.

Exit 0 when all are built (their paths printed), 1 when one could not be (why printed: no
compiler, no Python headers); the project works without them, only slower.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path


def main() -> int:
    from qforensics.hooks import fused, opcall, statsnative

    failed = 0
    jobs = [("fused_reduce.c", lambda: fused.build()),
            ("statsop_cpu.cpp", statsnative.build)]
    if (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        jobs.append(("opcall.c", opcall.LANE.build))
    else:
        print("opcall.c: not built (Python.h not found: install the Python headers)")
        failed = 1
    for name, job in jobs:
        try:
            print(f"{name}: {job()}")
        except Exception as exc:  # noqa: BLE001 - say why, go on: the project runs without
            print(f"{name}: not built ({type(exc).__name__}: {exc})")
            failed = 1
    return failed


if __name__ == "__main__":
    sys.exit(main())
