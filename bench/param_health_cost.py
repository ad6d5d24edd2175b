"""Cost of the parameter evidence captured at attach, per weight tensor: the new
`param_health(..., summarize=True)` (counts, first bad row, levels and dominance on 32 sampled
rows) against the counts alone (NaN/Inf/zero/subnormal, what capture recorded before).

    python bench/param_health_cost.py

Prints the best of 15 runs for a SmolLM2-sized [576, 1536] float32 weight, and the ratio.
"""

from __future__ import annotations

import time

import torch

from qforensics.hooks.params import param_health


def best(fn, n: int = 15) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)


if __name__ == "__main__":
    w = torch.randn(576, 1536)
    a = best(lambda: param_health(w, "weight"))
    b = best(lambda: param_health(w, "weight", summarize=True))
    print(f"counts only {a * 1e3:.2f} ms, with levels and dominance {b * 1e3:.2f} ms, "
          f"ratio {b / a:.2f}")
