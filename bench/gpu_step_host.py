"""The host time of a compiled step on the GPU's path: what the model's thread spends outside
the graph at each step's begin and end (issue 39: at most 0.1 ms a step).

    python bench/gpu_step_host.py                       # the GPU's path on this CPU's stand-ins
    python bench/gpu_step_host.py --device cuda         # the real thing, on a GPU

On the CPU the GPU's path runs through its stand-ins (graphlate.LATE_ON_CPU: steps emitted a
step late; graphstats.HOST_COPIES_ON_CPU: the ring's slot read through host copies, as the
GPU's pinned ones; a drainer thread building the records). The model is SmolLM2's module layout
(a Llama: the same modules per layer, so as many ring entries a layer) at toy widths (hidden 64,
vocab 512), so that the copies and the logits' op call cost what their launch costs, not the
bytes they move: the figure is capture's own host work. Each function is timed around every
call in the model's thread; printed: the median microseconds per step of each, over the steps
after every host slot was allocated, and of the whole (`root pre` + `root post`: a step's
begin and end), as wall time and as the thread's CPU time (the difference: waiting, for the
GIL the drainer thread holds, or for a core); and the whole's mean and 99th percentile, which
the rare long waits move. Timers add about a microsecond per wrapped call.

On the CPU the model runs on one torch thread by default (`--threads`): with two on a 2-core
machine the kernels' OpenMP threads spin on the core the drainer thread needs, and the mean
host time was 850-920 us a step against a median of ~300 (99th percentile ~4.7 ms), whatever
the interpreter's switch interval (5 or 0.5 ms: not the GIL); with one thread the mean was 330
and the 99th percentile 0.8 ms. On a GPU the device runs the model: no such contention.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (module, class, function): the step's begin and end, then the parts of the end
TIMED = [
    ("qforensics.hooks.callhooks", "CallHooks", "_on_root_pre"),
    ("qforensics.hooks.callhooks", "CallHooks", "_on_root_post"),
    ("qforensics.hooks.graphlate", "GraphLate", "_graph_end"),
    ("qforensics.hooks.graphmode", "GraphMode", "_graph_flush"),
    ("qforensics.hooks.graphstats", "GraphStats", "put_step_extras"),
    ("qforensics.hooks.graphstats", "GraphStats", "start_copy"),
    ("qforensics.hooks.graphlate", "GraphLate", "_graph_failed"),
    ("qforensics.hooks.drainer", "Drainer", "put"),
]


def _wrap(cur: collections.Counter) -> None:
    """Times each TIMED function's calls in the model's thread into `cur` (ns by name)."""
    import importlib
    import threading

    main = threading.main_thread()
    for mod, cls, name in TIMED:
        owner = getattr(importlib.import_module(mod), cls)
        fn = getattr(owner, name)
        key = f"{cls}.{name}"

        def timed(*a, _fn=fn, _key=key, **kw):  # noqa: ANN002, ANN003, ANN202
            if threading.current_thread() is not main:
                return _fn(*a, **kw)
            t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            try:
                return _fn(*a, **kw)
            finally:
                cur[_key] += time.perf_counter_ns() - t0
                cur["cpu " + _key] += time.thread_time_ns() - c0
        setattr(owner, name, timed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads on the CPU (default 1: on a GPU the device runs the "
                         "model, so no OpenMP thread of the model's kernels spins on the core "
                         "the drainer needs; 0: torch's default)")
    ap.add_argument("--mode", default=None,
                    help="torch.compile mode (default: reduce-overhead on CUDA, default on CPU)")
    a = ap.parse_args(argv)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import qforensics
    from qforensics.hooks import graphlate, graphmode, graphstats

    dev = torch.device(a.device)
    if dev.type == "cpu" and a.threads > 0:
        torch.set_num_threads(a.threads)
    if dev.type == "cpu":  # the GPU's path on its stand-ins
        graphlate.LATE_ON_CPU = True
        graphstats.HOST_COPIES_ON_CPU = True
        graphmode.DRAIN = "thread"
    mode = a.mode or ("reduce-overhead" if dev.type == "cuda" else "default")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=a.layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                      max_position_embeddings=256, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).to(dev).eval()
    comp = torch.compile(model, mode=mode)
    spent: dict[str, list[int]] = collections.defaultdict(list)  # ns per step, by function
    cur: collections.Counter = collections.Counter()
    _wrap(cur)
    width = 8 + a.steps
    x = torch.zeros(1, width, dtype=torch.long, device=dev)
    x[0, :8] = torch.arange(1, 9)
    n = 8
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    path = os.path.join(tempfile.mkdtemp(prefix="qf-step-host-"), "t.h5")
    with qforensics.capture(comp, path) as cap, torch.no_grad():
        for _ in range(a.steps):
            cur.clear()
            logits = comp(x).logits
            x[0, n] = int(logits[0, n - 1].argmax())  # a sync, as a generate loop has
            n += 1
            for _, cls, name in TIMED:
                for k in (f"{cls}.{name}", f"cpu {cls}.{name}"):
                    spent[k].append(cur[k])
        sync()
        slots = cap._gs.host_slots if cap._gs is not None else 0
    with qforensics.open_trace(path) as t:
        st = t.meta["status"]
        status = {"capture_mode": st.get("capture_mode"), "steps_recorded": t.n_steps,
                  "graph_drain": st.get("graph_drain")}
    skip = slots + 2  # every host slot's buffers allocated by then
    med = {k: statistics.median(v[skip:]) / 1e3 for k, v in spent.items() if len(v) > skip}
    total = med["CallHooks._on_root_pre"] + med["CallHooks._on_root_post"]
    total_cpu = med["cpu CallHooks._on_root_pre"] + med["cpu CallHooks._on_root_post"]
    # the mean, not only the median: a step kept waiting (for a core, for the GIL the drainer
    # holds) is rare and long, and a run pays for every one
    whole = [a + b for a, b in zip(spent["CallHooks._on_root_pre"][skip:],
                                   spent["CallHooks._on_root_post"][skip:])]
    mean = statistics.mean(whole) / 1e3 if whole else float("nan")
    median = statistics.median(whole) / 1e3 if whole else float("nan")
    p99 = sorted(whole)[int(0.99 * (len(whole) - 1))] / 1e3 if whole else float("nan")
    print(json.dumps({"device": a.device, "mode": mode, "layers": a.layers, "steps": a.steps,
                      "steps_timed": a.steps - skip, "host_slots": slots, **status,
                      "host_us_per_step": round(total, 1),
                      "host_us_median": round(median, 1), "host_us_mean": round(mean, 1),
                      "host_us_p99": round(p99, 1), "torch_threads": torch.get_num_threads(),
                      "host_cpu_us_per_step": round(total_cpu, 1),
                      "us_per_step": {k: round(v, 1) for k, v in med.items()
                                      if not k.startswith("cpu ")},
                      "cpu_us_per_step": {k[4:]: round(v, 1) for k, v in med.items()
                                          if k.startswith("cpu ")}}))
    os.remove(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
