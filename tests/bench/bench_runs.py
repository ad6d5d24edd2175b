"""Run a benchmark script of bench/ as its own process, the way a person runs it, and read the
figures it prints. The bench tests (tests/bench) run every script in a tiny mode (a few steps,
tokens or traces) so that none rots unnoticed; the figures themselves depend on the machine and
are only checked for being numbers that make sense."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
NUM = r"(-?\d[\d,]*(?:\.\d+)?|nan)"  # a printed figure: 1,234.5 / 0.56 / 7 / nan


def run_bench(script: str, *args: str, cwd: Path, timeout: float, ok: tuple[int, ...] = (0,)
              ) -> str:
    """`python bench/SCRIPT ARGS` in `cwd` with this interpreter; its stdout (asserts the exit
    status is one of `ok`). Children inherit the session's cache folder (tests/conftest.py)."""
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode in ok, (f"{script} exit {proc.returncode}\n{proc.stdout[-3000:]}\n"
                                   f"{proc.stderr[-3000:]}")
    return proc.stdout


def figures(pattern: str, text: str) -> tuple[float, ...]:
    """The numbers captured by `pattern` (NUM groups) in the first line of `text` it matches."""
    m = re.search(pattern, text)
    assert m, f"no line matches {pattern!r} in:\n{text[-3000:]}"
    return tuple(float(g.replace(",", "")) for g in m.groups())


def ratio_slack(num: float, den: float, digits: int = 3) -> float:
    """How far a printed ratio (of the unrounded figures, itself printed to `digits`
    decimals) may lie from num / den, where num and den are the figures as printed to `digits`
    decimals: each printed figure is within half a unit of its last digit."""
    half = 0.5 * 10.0 ** -digits
    return (half / num + half / den) * (num / den) * 1.01 + half + 1e-12
