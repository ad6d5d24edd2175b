"""Cost of the parameter evidence captured at attach, per weight tensor: the new
`param_health(..., summarize=True)` (counts, first bad row, levels and dominance on 32 sampled
rows) against the counts alone (NaN/Inf/zero/subnormal, what capture recorded before).

    python bench/param_health_cost.py [--every 256]

Prints the best of 15 runs for a SmolLM2-sized [576, 1536] float32 weight, and the ratio.

Then, when the real SmolLM2-135M is installed (qforensics.demo.model.load_model), the cost of
the parameter watch during the run (hooks/paramwatch.py): one check over every watched tensor
(the float32 sum per tensor into one buffer, and its read), a step end with no check due, and
the check amortized over `--every` steps against a plain one-token step of the model.
"""

from __future__ import annotations

import time

import torch

from qforensics.hooks.params import param_health
from qforensics.hooks.modules import select_modules
from qforensics.hooks.paramwatch import DEFAULT_EVERY, ParamWatch, watched_tensors


def best(fn, n: int = 15) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)


def watch_cost(every: int) -> None:
    try:
        from qforensics.demo.model import load_model

        model, tok = load_model()
    except Exception as exc:  # noqa: BLE001 - the real model is optional here
        print(f"param watch: SmolLM2 not loaded ({exc}); skipped")
        return
    watched = watched_tensors(select_modules(model, None), model)
    mb = sum(t.numel() * t.element_size() for _, _, _, t, _ in watched) / 1e6
    pw = ParamWatch(watched, every)
    # a step end with a check due (launched at the step's end, read with its records; on the
    # CPU both at once), and one with none due
    check = best(lambda: (pw.tick(every - 1), pw.step_end(every - 1, False)), 7)
    idle = best(lambda: (pw.tick(0), pw.step_end(0, False)), 200)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():  # a one-token forward: a decode step's cost at a short context
        nxt = model(ids).logits[:, -1:].argmax(-1)
        step = best(lambda: model(nxt, use_cache=False), 7)
    amort = check / every + idle
    print(f"param watch on SmolLM2-135M ({len(watched)} tensors, {mb:.0f} MB, "
          f"{torch.get_num_threads()} threads): a check {check * 1e3:.1f} ms, a step end "
          f"without one {idle * 1e6:.1f} us; every {every} steps: {amort * 1e3:.3f} ms a step "
          f"against a plain one-token step of {step * 1e3:.1f} ms ({100 * amort / step:.2f}%)")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=int, default=DEFAULT_EVERY)
    args = ap.parse_args()
    w = torch.randn(576, 1536)
    a = best(lambda: param_health(w, "weight"))
    b = best(lambda: param_health(w, "weight", summarize=True))
    print(f"counts only {a * 1e3:.2f} ms, with levels and dominance {b * 1e3:.2f} ms, "
          f"ratio {b / a:.2f}")
    watch_cost(args.every)
