"""What one call of the compiled-mode stats op costs on the CPU, per path, side by side in one run.

    python bench/stats_op_cost.py
    python bench/stats_op_cost.py --calls 5000

A decoder layer's group as graphhooks hands it over (SmolLM2's widths: attention input shared
by q/k/v, their outputs, o_proj, gate/up sharing their input, down_proj: 14 tensors, 9 of them
distinct), at three shapes (vLLM decode: 8 rows bf16; HF decode: 1 row float32; HF re-fed: 22
rows float32):
- c++: through `torch.ops.qforensics.stats`, the C++ kernel behind the dispatcher
  (hooks/statsop_cpu.cpp; the default wherever it is built), no Python in the call;
- group: the Python kernel (hooks/statscpu.py, called as the dispatcher would), the whole call
  in one call of fused_reduce.c's qf_group;
- each: the Python kernel tensor by tensor, one C call each (the path when qf_group is not
  loaded).
Printed: this thread's CPU time per op call and per tensor, and the ratios to c++; plus the
cost of a dispatcher call with no tensor.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000, help="timed op calls per case")
    a = ap.parse_args(argv)

    import torch

    from qforensics.hooks import fused, statscpu, statsnative, statsop

    if not (fused.REDUCER.ready() or (fused.REDUCER.wait() or fused.REDUCER.ready())):
        raise SystemExit(f"fused_reduce.c is not loaded: {fused.REDUCER.off}")
    if statsnative.KERNEL["kernel"] != "c++":
        raise SystemExit(f"the C++ kernel is not loaded: {statsnative.KERNEL['why']}")
    torch.manual_seed(0)
    real_group = fused.REDUCER.group
    cpu = torch.device("cpu")
    for rows, dt in ((8, torch.bfloat16), (1, torch.float32), (22, torch.float32)):
        h, q, k = (torch.randn(rows, w).to(dt) for w in (576, 576, 192))
        g, d = torch.randn(rows, 1536).to(dt), torch.randn(rows, 576).to(dt)
        xs = [h, h, h, q, k, k, q, d, h, h, g, g, g, d]
        n = len(xs)
        caps = [x.shape[-1] for x in xs]
        toks = [64] * n
        offs, o = [], 0
        for c, t in zip(caps, toks):
            offs.append(o)
            o += statsop.entry_width(c)
        ring, first, snap = torch.zeros(4, o), statsop.new_first(cpu), statsop.new_snap(cpu, 0)
        tring = statsop.new_toks(4, 64, n, cpu)
        args = (ring, tring, first, torch.tensor(1), offs, caps, toks, list(range(n)), snap,
                [-1] * n)
        per = {}
        for mode in ("c++", "group", "each"):
            fused.REDUCER.group = real_group if mode != "each" else (lambda: None)
            call = statsop.stats if mode == "c++" else statscpu.stats_cpu
            try:
                for _ in range(50):
                    call(xs, *args)
                t0 = time.thread_time()
                for _ in range(a.calls):
                    call(xs, *args)
                per[mode] = (time.thread_time() - t0) / a.calls
            finally:
                fused.REDUCER.group = real_group
        print(f"{rows:>2} rows {str(dt).replace('torch.', ''):>8}: "
              + ", ".join(f"{m} {per[m] * 1e6:6.1f} us/call ({per[m] * 1e6 / n:.2f}/tensor)"
                          for m in per)
              + f"; group/c++ {per['group'] / per['c++']:.2f}, each/c++ "
              f"{per['each'] / per['c++']:.2f}")
    t0 = time.thread_time()
    for _ in range(a.calls):
        statsop.stats([], ring, tring, first, torch.tensor(1), [], [], [], [], snap, [])
    print(f"a dispatcher call with no tensor (c++): "
          f"{(time.thread_time() - t0) / a.calls * 1e6:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
