"""Capture in compiled mode against the plain compiled model, side by side in one run.

    python bench/compiled_capture.py                        # the real SmolLM2, CPU, 16 tokens
    python bench/compiled_capture.py --random --layers 4    # SmolLM2's architecture, 4 layers
    python bench/compiled_capture.py --device cuda --dtype bfloat16 --mode reduce-overhead
    python bench/compiled_capture.py --kv-cache             # a KV-cached decode step

Each phase runs in a child process of its own with a fresh Inductor cache, so that neither
compile reuses the other's work: `plain` (torch.compile of the model) and `captured` (the same,
under `qforensics.capture`). Both generate greedily with a static shape: the whole sequence
re-fed every step, no KV cache, so every step runs the same graph. With `--kv-cache`, as HF's
compiled generation runs: a static KV cache (transformers' StaticCache), the prompt in one
prefill step, then one token a step; two graphs (prefill, decode), so "compile plus first
step" is the first two steps and the median is over the decode steps after them. Printed, one
JSON line per phase, then the comparison:
- compile plus first step (s), and the median later step (ms), with their ratios;
- where the compile's time went (`compile_phases`: Dynamo's trace, its guards, AOTAutograd and
  Inductor, from torch._dynamo.utils.compile_times), and captured / plain per phase;
- the kernels Inductor generated, and the stats-op calls in its output code (capture's cost
  in the graph: at most one call per recorded tensor, no generated kernel);
- the host time capture adds per step: its step hooks (begin, end, records, writer hand-off),
  which run outside the graph, as wall time and as this thread's CPU time, and of that wall
  time the op call on the logits (`host_op_ms_per_step`: on the CPU the reduction itself,
  over every position the static-shape step re-feeds; on a GPU a launch);
- on a loaded machine wall times wander: each step's CPU time (all threads of the process) is
  printed too, with its ratio (`step_cpu_ratio`);
- whether the tokens are identical, and whether every module was recorded at every step;
- on CUDA, torch's count of skipped CUDA graphs (`cudagraph_skips`, want 0) and the device
  memory capture adds (`cuda_mib_added`, peak against plain's); the ring's and the token ring's
  sizes (`graph_ring`) and, with a drainer, its waits (`graph_drain`); on the CPU, which
  kernel the op ran (`stats_kernel`: c++, or python where it is not built) and the tensors
  the Python kernel left to numpy (`numpy_redos`).
With `--drain both` one captured phase builds the records in the drainer thread
(QFORENSICS_DRAIN=thread) and one in the model's thread (sync), against the same plain phase; each
captured phase prints the CPU time spent building records (`drain_cpu_ms_per_step`), in
whichever thread did it.
With `--flush-interval S` the writer writes every S seconds (default 1): on the CPU, where a
step takes ~0.1 s, a long one leaves as many steps to a write as a GPU's ~2 ms steps do, so
that most ring steps are never written (hooks/ringranges.py).
With `--profile` the captured phase also prints where its host time goes, per step
(bench/step_timers.py: the writer's writes, `collect`, the logits' op, ...), on stderr.
With `--nan` the captured phase then goes on for NAN_STEPS more steps, with one row of the last
layer's down_proj weight overwritten with NaN in place before the first of them (as a kernel's
stray store would), and prints analyze's verdict and cause: the first non-finite step should be
step `--tokens`, its producer that down_proj. The timings and tokens compared are those of the
first `--tokens` steps.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# the project itself, installed or not (a GPU machine carries the checkout only)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import compiled_parts as parts  # noqa: E402

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
               tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192,
               rms_norm_eps=1e-5)
NAN_STEPS = 4
NAN_ROW = 100
PROMPT = [1, 504, 3458, 282, 4649, 314]  # a fixed id sequence for the random-weight model


def build(a: argparse.Namespace):  # noqa: ANN201
    import torch

    dtype = getattr(torch, a.dtype)
    model, ids, how = None, None, "random"
    if not a.random:
        try:
            from qforensics.demo.model import load_model

            model, tok = load_model(a.dtype)
            ids = tok("The capital of France is", return_tensors="pt").input_ids[0].tolist()
            how = "real"
        except Exception as exc:  # noqa: BLE001 - the package or its deps are missing
            print(f"real SmolLM2 not available ({type(exc).__name__}: {exc}); "
                  "using its architecture with random weights", file=sys.stderr)
    if model is None:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = dict(SMOLLM2)
        if a.layers:
            cfg["num_hidden_layers"] = a.layers
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**cfg)).to(dtype)
        ids = PROMPT
    elif a.layers:
        model.model.layers = model.model.layers[:a.layers]
        model.config.num_hidden_layers = a.layers
    return model.to(a.device).eval(), ids, how


def child(a: argparse.Namespace) -> dict:
    import torch

    model, ids0, how = build(a)
    dev = torch.device(a.device)
    steps = a.tokens + (NAN_STEPS if a.nan and a.phase == "captured" else 0)
    width = len(ids0) + steps
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    host = [0.0, 0, 0.0, 0.0]  # wall s, calls, this thread's CPU s, of which the outside op's
    drain = [0.0, 0]  # CPU s building records from the ring (the drainer's thread, or this)
    host_timed = None
    out: dict = {"phase": a.phase, "model": how, "device": a.device, "dtype": a.dtype,
                 "layers": model.config.num_hidden_layers, "tokens": a.tokens}
    timers = None
    if a.phase == "captured":
        import qforensics
        from qforensics.hooks.callhooks import CallHooks

        if a.profile:
            from step_timers import profile

            timers = profile()

        for name in ("_on_root_pre", "_on_root_post"):
            orig = getattr(CallHooks, name)

            def timed(*args, _f=orig, **kw):  # noqa: ANN002, ANN003, ANN202
                t0, c0 = time.perf_counter(), time.thread_time()
                try:
                    return _f(*args, **kw)
                finally:
                    host[0] += time.perf_counter() - t0
                    host[1] += 1
                    host[2] += time.thread_time() - c0
            setattr(CallHooks, name, timed)
        from qforensics.hooks.graphmode import GraphMode

        flush_outside = GraphMode._graph_flush

        def timed_flush(self):  # noqa: ANN001, ANN202 - the logits' op call, in the root hook
            t0 = time.perf_counter()
            try:
                return flush_outside(self)
            finally:
                host[3] += time.perf_counter() - t0
        GraphMode._graph_flush = timed_flush

        emit = GraphMode._graph_emit_many

        def timed_emit(self, ns):  # noqa: ANN001, ANN202 - in whichever thread
            c0 = time.thread_time()
            try:
                return emit(self, ns)
            finally:
                drain[0] += time.thread_time() - c0
                drain[1] += len(ns)  # steps: a drainer behind emits several in one call
        GraphMode._graph_emit_many = timed_emit
    comp = torch.compile(model, mode=a.mode)
    tmp = tempfile.mkdtemp(prefix="qf-compiled-bench-")
    path = os.path.join(tmp, "trace.h5")
    ctx = (qforensics.capture(comp, path, flush_interval=a.flush_interval)
           if a.phase == "captured" else None)
    if ctx is not None:
        ctx.__enter__()
    x = torch.zeros((1, width), dtype=torch.long, device=dev)
    x[0, :len(ids0)] = torch.tensor(ids0, device=dev)
    n, toks, times, cpu = len(ids0), [], [], []
    forward = parts.kv_forward(comp, model, width, dev) if a.kv_cache else (lambda x, n, i: comp(x))
    warm = 2 if a.kv_cache else 1  # steps that compile: prefill and decode, or the one graph
    with torch.no_grad():
        for i in range(steps):
            if i == a.tokens:
                w = model.model.layers[-1].mlp.down_proj.weight
                w[NAN_ROW].fill_(float("nan"))  # in place, as a kernel's stray store would
            sync()
            if i == warm:
                host[:] = [0.0, 0, 0.0, 0.0]  # the compiling steps (and attach) left out
                drain[:] = [0.0, 0]
                if timers is not None:
                    for d in timers:
                        d.clear()
            if i == a.tokens and timers is not None:  # the timed steps' figures only
                timers = tuple(dict(d) for d in timers)
            if i == a.tokens:
                host_timed = (host[0], host[2], host[3])
            t0, c0 = time.perf_counter(), time.process_time()
            logits = forward(x, n, i).logits
            nxt = int(logits[0, -1 if a.kv_cache else n - 1].float().argmax())
            sync()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            x[0, n] = nxt
            toks.append(nxt)
            n += 1
    # what Dynamo and Inductor counted, read before the capture closes: closing drops the
    # compiled code of a model the user compiled (torch._dynamo.reset, which clears the
    # counters too; hooks/graphmode.py's _graph_recompile)
    out.update(parts.output_code())
    out["compile_phases"] = parts.compile_phases()
    if dev.type == "cuda":
        from torch._dynamo.utils import counters

        out["cudagraph_skips"] = int(counters["inductor"]["cudagraph_skips"])
        out["cuda_max_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    if ctx is not None:
        ctx.__exit__(None, None, None)
    if timers is not None:
        from step_timers import report

        n_timed = max(1, a.tokens - 1)
        print(f"where the captured step's host time goes (steps 1-{n_timed}):",
              file=sys.stderr)
        sys.stdout, saved = sys.stderr, sys.stdout
        try:
            report(*timers, n_timed)
        finally:
            sys.stdout = saved
    out["kv_cache"] = bool(a.kv_cache)
    out["first_step_s"] = round(sum(times[:warm]), 3)
    out["median_ms"] = round(statistics.median(times[warm:a.tokens]) * 1e3, 3)
    # CPU time of the whole process (every thread): on a loaded machine the steadier figure
    out["median_cpu_ms"] = round(statistics.median(cpu[warm:a.tokens]) * 1e3, 3)
    out["steps_ms"] = [round(t * 1e3, 2) for t in times[warm:]]
    out["tokens_out"] = toks[:a.tokens]
    if a.phase == "captured":
        wall, cpu_s, op_s = (host[0], host[2], host[3]) if host_timed is None else host_timed
        timed = max(1, a.tokens - warm)
        out["host_ms_per_step"] = round(wall / timed * 1e3, 4)
        # of it, the op call on what ran outside the graph (the logits): on the CPU the
        # reduction itself runs there, on a GPU it is a launch
        out["host_op_ms_per_step"] = round(op_s / timed * 1e3, 4)
        out["host_cpu_ms_per_step"] = round(cpu_s / timed * 1e3, 4)
        out["drain"] = os.environ.get("QFORENSICS_DRAIN", "auto")
        out["drain_cpu_ms_per_step"] = round(drain[0] / max(1, drain[1]) * 1e3, 4)
        out.update(parts.trace_facts(path))
        if a.nan:
            out["nan_planted"] = {"step": a.tokens, "row": NAN_ROW, "module":
                                  f"model.layers.{out['layers'] - 1}.mlp.down_proj"}
    shutil.rmtree(tmp, ignore_errors=True)  # the trace (tens of MB): its facts are read
    return out


def run_phase(a: argparse.Namespace, phase: str, drain: str = "auto") -> dict:
    cache = tempfile.mkdtemp(prefix="qf-inductor-")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
           "TORCHINDUCTOR_AUTOGRAD_CACHE": "0", "QFORENSICS_DRAIN": drain}
    cmd = [sys.executable, os.path.abspath(__file__), "--phase", phase, "--tokens",
           str(a.tokens), "--device", a.device, "--dtype", a.dtype, "--mode", a.mode,
           "--layers", str(a.layers)] + (["--random"] if a.random else []) + (
        ["--nan"] if a.nan else []) + (["--profile"] if a.profile else []) + [
        "--flush-interval", str(a.flush_interval)] + (["--kv-cache"] if a.kv_cache else [])
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
    finally:
        shutil.rmtree(cache, ignore_errors=True)  # this phase's fresh Inductor cache
    if r.returncode != 0:
        sys.stderr.write(r.stderr[-4000:])
        raise SystemExit(f"{phase} phase failed (exit {r.returncode})")
    if a.profile:
        lines = r.stderr.splitlines()
        at = next((i for i, ln in enumerate(lines) if ln.startswith("where the captured")), None)
        if at is not None:
            sys.stderr.write("\n".join(lines[at:at + 40]) + "\n")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    got["wall_s"] = round(time.perf_counter() - t0, 1)
    return got


def compare(p: dict, c: dict) -> dict:
    return {
        "kv_cache": bool(c.get("kv_cache")),
        "compile_ratio": round(c["first_step_s"] / p["first_step_s"], 3),
        "step_ratio": round(c["median_ms"] / p["median_ms"], 3),
        "step_cpu_ratio": round(c["median_cpu_ms"] / p["median_cpu_ms"], 3),
        "host_ms_per_step": c.get("host_ms_per_step"),
        "host_cpu_ms_per_step": c.get("host_cpu_ms_per_step"),
        "host_op_ms_per_step": c.get("host_op_ms_per_step"),
        "drain": c.get("drain"),
        "drain_cpu_ms_per_step": c.get("drain_cpu_ms_per_step"),
        "kernels_added": c["generated_kernels"] - p["generated_kernels"],
        "stats_op_calls": c["stats_op_calls"],
        "calls_per_module": round(c["stats_op_calls"] / max(1, c.get("graph_calls") or 1), 2),
        "tokens_identical": p["tokens_out"] == c["tokens_out"],
        "tokens": c["tokens_out"],
        "every_module_every_step": c.get("every_module_every_step"),
        "spilled_steps": c.get("spilled_steps"),
        "cudagraph_skips": c.get("cudagraph_skips"),
        # a GPU: the memory capture adds (its ring, token ring, snapshot buffer, pinned
        # copies are host memory and not counted here)
        "cuda_mib_added": (round(c["cuda_max_mib"] - p["cuda_max_mib"], 1)
                           if "cuda_max_mib" in c and "cuda_max_mib" in p else None),
        "graph_ring": c.get("graph_ring"),
        # captured / plain per compile phase (Dynamo's trace is where hooks cost most)
        "compile_phase_ratios": {k: round(c["compile_phases"][k] / v, 2)
                                 for k, v in p.get("compile_phases", {}).items()
                                 if v > 0 and k in c.get("compile_phases", {})},
    }


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--mode", default="default", help="torch.compile mode")
    ap.add_argument("--layers", type=int, default=0, help="keep the first N layers (0: all)")
    ap.add_argument("--random", action="store_true", help="random weights, SmolLM2's shapes")
    ap.add_argument("--nan", action="store_true",
                    help="then plant a NaN weight row and check where analyze places it")
    ap.add_argument("--profile", action="store_true",
                    help="print where the captured step's host time goes (stderr)")
    ap.add_argument("--drain", choices=("auto", "thread", "sync", "both"), default="auto",
                    help="where compiled steps' records are built (QFORENSICS_DRAIN): auto "
                         "(the drainer thread on a GPU, the model's thread on the CPU), thread, "
                         "sync, or both: a captured phase of each of thread and sync, compared "
                         "with the same plain phase")
    ap.add_argument("--timeout", type=int, default=1200)
    ap.add_argument("--flush-interval", type=float, default=1.0,
                    help="the writer's flush interval (s): steps per write, as on a GPU's "
                    "~500 steps a second, with a longer one on the CPU")
    ap.add_argument("--kv-cache", action="store_true",
                    help="a static KV cache: the prompt, then one token a step (HF's compiled "
                         "generation), instead of the whole sequence re-fed")
    ap.add_argument("--phase", choices=("plain", "captured"), help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.phase:
        print(json.dumps(child(a)))
        return 0
    p = run_phase(a, "plain")
    print(json.dumps({k: v for k, v in p.items() if k != "tokens_out"}), flush=True)
    drains = ("thread", "sync") if a.drain == "both" else (a.drain,)
    phases = {}
    for d in drains:
        phases[d] = c = run_phase(a, "captured", d)
        print(json.dumps({k: v for k, v in c.items() if k != "tokens_out"}), flush=True)
    for c in phases.values():
        print(json.dumps(compare(p, c)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
