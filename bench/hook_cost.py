"""Host-side cost of capture per decode step, without the model (steadier than end-to-end
timing on a shared machine).

    python bench/hook_cost.py [--steps 200]
    python bench/hook_cost.py --vllm          # vLLM decode: 8 requests' rows, bfloat16, [rows, C]
    QFORENSICS_REDUCE=eager python bench/hook_cost.py --vllm   # the eager reduction instead of
                                              # the one-pass kernel (hooks/fused.py)

Feeds SmolLM2-135M-shaped decode tensors (30 layers: q/k/v/o, gate/up/down, the block) through
what the hooks do, single-threaded, and prints CPU milliseconds per step for:
  bare               one per-channel absmax (abs + amax) per Linear input, as the bare
                     pre-hook does
  take               qforensics' hook-time work on the generic path (PendingStep.take:
                     copies, bookkeeping), as in a step unlike any before it
  take+reduce        plus the end-of-step batched reduction (reduce_on_device)
  plan take          the same on the step plan (hooks/plan.py), as in every decode step
                     after the first: checks, copy_ into preallocated buffers
  plan take+reduce   plus the end-of-step reduction of those buffers
Compare with a plain decode step of the model on the same machine (about 80 ms here on one
thread). Not a test.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from qforensics.hooks import fused
from qforensics.hooks.pending import PendingStep

D, F, KV = 576, 1536, 192  # SmolLM2-135M hidden, MLP and k/v widths


def layer_tensors(rows: int = 1, dtype: torch.dtype = torch.float32, flat: bool = False
                  ) -> dict[str, torch.Tensor]:
    shapes = dict(ain=D, q=D, k=KV, v=KV, oin=D, o=D, min=D, g=F, u=F, din=F, dn=D, bin=D,
                  bout=D)
    lead = (rows,) if flat else (1, rows)  # vLLM flattens the batch's token rows: [rows, C]
    return {k: torch.randn(*lead, n).to(dtype) for k, n in shapes.items()}


CALLS = (("ain", "q"), ("ain", "k"), ("ain", "v"), ("oin", "o"), ("min", "g"), ("min", "u"),
         ("din", "dn"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rows", type=int, default=1,
                    help="token rows per step (a vLLM decode step: one per running request)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--vllm", action="store_true",
                    help="vLLM's layout: [rows, C] tensors, bfloat16, 8 rows unless --rows")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.vllm and args.dtype == "float32" else getattr(torch, args.dtype)
    rows = 8 if args.vllm and args.rows == 1 else args.rows
    print(f"{rows} token row(s), {dtype}, {'[rows, C]' if args.vllm else '[1, rows, C]'}, "
          f"{args.threads} thread(s)")
    layers = [layer_tensors(rows, dtype, args.vllm) for _ in range(30)]
    p = PendingStep()
    p.track, p.nograd = False, True  # as under torch.inference_mode()

    def bare() -> None:
        kept = []
        for lt in layers:
            for inp, _ in CALLS:
                kept.append(lt[inp].abs().amax(dim=tuple(range(lt[inp].dim() - 1))))

    def take() -> None:
        p.start("decode", 0)
        ci = 0
        for lt in layers:
            for inp, out in CALLS:
                p.take(ci, 1, 0, 0, lt[inp])
                p.take(ci, 1, 1, 0, lt[out])
                ci += 1
            p.take(ci, 2, 0, 0, lt["bin"])
            p.take(ci, 2, 1, 0, lt["bout"])
            ci += 1

    def take_reduce() -> None:
        take()
        p.reduce_on_device()

    def no_plans() -> None:
        p.plans.clear()

    def learn() -> None:  # one generic step, whose plan the next steps of its key run on
        take()
        p.learn()
        p.clear()

    runs: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {
        "bare": (bare, no_plans), "take": (take, no_plans), "take+reduce": (take_reduce, no_plans),
        "plan take": (take, learn), "plan take+reduce": (take_reduce, learn)}
    with torch.inference_mode():
        for name, (fn, setup) in runs.items():
            setup()
            for _ in range(5):
                fn()
                if name.startswith("plan"):
                    assert p.on_plan, "the plan did not hold"
                p.clear()
            fused.REDUCER.wait()  # the one-pass reduction (hooks/fused.py) is built off-thread
            t, w = time.process_time(), time.perf_counter()
            for _ in range(args.steps):
                fn()
                p.clear()
            print(f"{name:<17} {(time.process_time() - t) / args.steps * 1e3:6.2f} ms CPU, "
                  f"{(time.perf_counter() - w) / args.steps * 1e3:6.2f} ms wall per step")

    st = fused.REDUCER.status()
    how = st.get("reduction_off") or "one pass, hooks/fused_reduce.c"
    print(f"end-of-step reduction: {st['reduction']} ({how}; QFORENSICS_REDUCE=eager for the "
          "eager one)")


if __name__ == "__main__":
    main()
