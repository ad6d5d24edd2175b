"""What one call of the compiled-mode stats op costs on the CPU, per path, side by side in one run.

    python bench/stats_op_cost.py
    python bench/stats_op_cost.py --calls 5000
    python bench/stats_op_cost.py --in-run 32      # the op inside a run of the real SmolLM2

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

With `--in-run N` it instead times the op where it runs: the real SmolLM2 (eager, float32, one
thread) generates N greedy tokens under `qforensics.capture(model, path, compiled=True)`, whose
hooks call the op once per decoder layer, each call wrapped in a thread-time timer (~1 us
added). Printed: op time per decode step, the median call, and the same call repeated hot
afterwards (the difference is cache and page misses: the ring's slots, first touched).
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
    ap.add_argument("--in-run", type=int, default=0, metavar="TOKENS",
                    help="time the op inside a capture of the real SmolLM2 instead")
    a = ap.parse_args(argv)
    if a.in_run:
        return in_run(a.in_run)

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


def in_run(tokens: int) -> int:
    """The op's thread time per decode step and per call inside a captured generation."""
    import statistics
    import tempfile
    import types

    import torch

    import qforensics
    from qforensics.demo.model import load_model
    from qforensics.hooks import graphhooks, graphmode

    torch.set_num_threads(1)
    model, tok = load_model()
    enc = tok("The capital of France is", return_tensors="pt")
    graphmode.selftest(torch.device("cpu"))  # traced once, before the op is wrapped
    real = torch.ops.qforensics.stats
    calls: list[tuple[float, tuple]] = []

    def timed(*args):  # noqa: ANN002, ANN202
        t0 = time.thread_time()
        real(*args)
        calls.append((time.thread_time() - t0, args))

    class _Torch:  # graphhooks' `torch`, the op replaced by the timed one
        ops = types.SimpleNamespace(qforensics=types.SimpleNamespace(stats=timed))

        def __getattr__(self, name: str):  # noqa: ANN204
            return getattr(torch, name)

    graphhooks.torch = _Torch()
    path = os.path.join(tempfile.mkdtemp(prefix="qf-op-in-run-"), "t.h5")
    with qforensics.capture(model, path, compiled=True), torch.inference_mode():
        model.generate(**enc, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                       pad_token_id=tok.eos_token_id)
    graphhooks.torch = torch
    per_step = len(calls) // tokens  # the same calls every step: prefill then decode steps
    dec = calls[per_step:]
    med = statistics.median(t for t, _ in dec)
    args = dec[len(dec) // 2][1]
    t0 = time.thread_time()
    for _ in range(200):
        real(*args)
    hot = (time.thread_time() - t0) / 200
    print(f"SmolLM2, {tokens} tokens, {per_step} op calls a step: "
          f"{sum(t for t, _ in dec) / (tokens - 1) * 1e3:.2f} ms of op time a decode step; "
          f"median call {med * 1e6:.1f} us, the same call hot {hot * 1e6:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
