"""Compiled-mode capture on a GPU, in one command, for a task that is lent one:

    python scripts/gpu_check.py                  # writes gpu-check/ beside the checkout
    python scripts/gpu_check.py --out /tmp/gpu --tokens 32
    python scripts/gpu_check.py --kv-cache --random --layers 4   # a one-token decode step

SmolLM2 (the real one where its package is installed, else its architecture with random
weights), bfloat16, `torch.compile(mode="reduce-overhead")` (CUDA graphs), greedy with a static
shape: plain, then under `qforensics.capture`, each in a fresh process with a fresh Inductor
cache (bench/compiled_capture.py does the measuring). Then a NaN row is written in place into
the last layer's down_proj weight and analyze must place the failure at that step and module.

Needs only torch, transformers, h5py, click, pandas and matplotlib (run from the checkout with
PYTHONPATH=$PWD). Prints every figure and target, writes the raw JSON lines to OUT/, and exits
0 when every target holds, 1 when one does not, 2 without a GPU (`--allow-cpu` runs the same
on the CPU, to check the script itself; its figures are not GPU figures).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bench"))

import compiled_capture as cc  # noqa: E402

# issue targets for the GPU (H200, full SmolLM2 architecture, bf16, reduce-overhead)
STEP_RATIO_MAX = 1.05
COMPILE_RATIO_MAX = 1.3


def targets(cmp: dict, cap: dict) -> list[tuple[str, bool, str]]:
    """(name, held, figure) of each target."""
    planted = cap.get("nan_planted") or {}
    verdict = cap.get("verdict") or ""
    located = bool(planted) and (f"at step {planted['step']}," in verdict
                                 and planted["module"] in verdict)
    return [
        ("captured step <= 1.05 x plain", cmp["step_ratio"] <= STEP_RATIO_MAX,
         f"{cmp['step_ratio']:.3f}"),
        ("compile + first step <= 1.3 x plain", cmp["compile_ratio"] <= COMPILE_RATIO_MAX,
         f"{cmp['compile_ratio']:.3f}"),
        ("tokens identical", bool(cmp["tokens_identical"]), str(cmp["tokens_identical"])),
        ("every module recorded at every step", bool(cmp["every_module_every_step"]),
         f"{cmp['every_module_every_step']} (steps spilled by a lagging drainer: "
         f"{cmp.get('spilled_steps')})"),
        ("no cudagraph skip", cmp.get("cudagraph_skips") == 0, str(cmp.get("cudagraph_skips"))),
        ("planted NaN located (step, producer)", located, verdict[:160]),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu-check")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--layers", type=int, default=0, help="keep the first N layers (0: all)")
    ap.add_argument("--random", action="store_true", help="random weights even if real")
    ap.add_argument("--kv-cache", action="store_true",
                    help="a static KV cache: one token a decode step, as HF's compiled "
                         "generation runs (the targets are read on its decode steps)")
    ap.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=int, default=280, help="per phase, seconds")
    o = ap.parse_args(argv)
    import torch

    on_gpu = torch.cuda.is_available()
    if not on_gpu and not o.allow_cpu:
        print("no CUDA device: nothing measured", file=sys.stderr)
        return 2
    a = cc.parser().parse_args([
        "--tokens", str(o.tokens), "--layers", str(o.layers), "--nan",
        "--timeout", str(o.timeout), "--device", "cuda" if on_gpu else "cpu",
        "--dtype", "bfloat16" if on_gpu else "float32",
        "--mode", "reduce-overhead" if on_gpu else "default"] + (
        ["--random"] if o.random else []) + (["--kv-cache"] if o.kv_cache else []))
    os.makedirs(o.out, exist_ok=True)
    t0 = time.perf_counter()
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if on_gpu
           else "cpu", "argv": sys.argv[1:]}
    lines = [env]
    print(json.dumps(env), flush=True)
    p = cc.run_phase(a, "plain")
    lines.append(p)
    print(json.dumps({k: v for k, v in p.items() if k != "tokens_out"}), flush=True)
    c = cc.run_phase(a, "captured")
    lines.append(c)
    print(json.dumps({k: v for k, v in c.items() if k != "tokens_out"}), flush=True)
    cmp = cc.compare(p, c)
    res = targets(cmp, c)
    summary = {"compare": cmp, "targets": {n: {"held": h, "figure": f} for n, h, f in res},
               "cause": c.get("cause"), "seconds": round(time.perf_counter() - t0, 1)}
    lines.append(summary)
    with open(os.path.join(o.out, "compiled-capture.jsonl"), "w") as f:
        f.writelines(json.dumps(x) + "\n" for x in lines)
    for n, h, fig in res:
        print(f"{'ok  ' if h else 'MISS'} {n}: {fig}")
    print(f"cause: {c.get('cause')}")
    print(f"step CPU-time ratio {cmp['step_cpu_ratio']}; host ms per step "
          f"{cmp['host_ms_per_step']} (CPU {cmp['host_cpu_ms_per_step']}), stats-op calls "
          f"{cmp['stats_op_calls']} ({cmp['calls_per_module']} per module), kernels added "
          f"{cmp['kernels_added']}; {summary['seconds']} s")
    print(f"device memory added {cmp.get('cuda_mib_added')} MiB; ring {cmp.get('graph_ring')}; "
          f"drainer {c.get('graph_drain')}")
    return 0 if all(h for _, h, _ in res) else 1


if __name__ == "__main__":
    sys.exit(main())
