"""Time `qforensics analyze` on a synthetic ~1 GB trace.

    python bench/analyze_speed.py                  # writes /tmp/qforensics-bench-1gb.h5 once
    python bench/analyze_speed.py --size-gb 2 --path big.h5 --regenerate

The trace is written with TraceWriter (no torch): many steps (a prefill of 512 tokens, then one
token per step), 12 layers of 4 linear modules plus the block, every record with per-channel
ranges over 4,096 channels (fresh random values, so gzip cannot shrink them), and a NaN produced
by model.layers.7.mlp.down_proj at 80% of the steps that then spreads to every later step. The
analyzer must read only the per-step summaries, the failing step's records and channel ranges,
and a few narrow record columns; the target is at most 1 s, measured here as the wall time of the
`qforensics analyze` command in a fresh subprocess (interpreter start-up and imports included).
With PYTHONDONTWRITEBYTECODE set (or python -B), qforensics' own modules are compiled from source
on every start (about 0.1 s here); the script says so when it is.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time

import numpy as np

from qforensics.trace import schema
from qforensics.trace.writer import StepBatch, TraceWriter

LAYERS = 12
LINEARS = ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")
CHANNELS = 4096
PREFILL = 512


def modules() -> list[dict[str, str]]:
    out = []
    for i in range(LAYERS):
        for lin in LINEARS:
            out.append({"name": f"model.layers.{i}.{lin}", "type": "Linear", "kind": "linear",
                        "info": "{}"})
        out.append({"name": f"model.layers.{i}", "type": "Block", "kind": "block", "info": "{}"})
    out.append({"name": "", "type": "Model", "kind": "root", "info": "{}"})
    return out


def make_batch(rng: np.random.Generator, step: int, first_call: int, bad_from: int) -> StepBatch:
    n_calls = LAYERS * 5 + 1
    n_rec = LAYERS * 5 * 2 + 1
    tokens = PREFILL if step == 0 else 1
    rec = np.zeros(n_rec, schema.record_dtype())
    calls = np.repeat(np.arange(LAYERS * 5), 2)
    rec["call_index"][:-1] = first_call + calls
    rec["call_index"][-1] = first_call + n_calls - 1
    rec["module_id"][:-1] = calls
    rec["module_id"][-1] = LAYERS * 5
    rec["io"][:-1] = np.tile([0, 1], LAYERS * 5)
    rec["io"][-1] = 1
    rec["step"] = step
    rec["channels"] = CHANNELS
    rec["channels"][-1] = 32000
    rec["rows"] = tokens
    rec["numel"] = rec["rows"] * rec["channels"]
    n_chan = n_rec - 1  # the logits record keeps no channel ranges (wider than channel_limit)
    cmax = rng.random(n_chan * CHANNELS, dtype=np.float32) * 2
    cmin = -rng.random(n_chan * CHANNELS, dtype=np.float32) * 2
    cmax[np.arange(n_chan) * CHANNELS + 1229] *= 400  # one massive-activation channel
    rec["chan_offset"][:-1] = np.arange(n_chan) * CHANNELS
    rec["chan_offset"][-1] = -1
    rec["tok_offset"] = np.arange(n_rec) * tokens
    rec["tok_count"] = tokens
    tok = rng.random(n_rec * tokens, dtype=np.float32) * 10
    am = np.maximum(np.abs(cmin), np.abs(cmax)).reshape(n_chan, CHANNELS).max(axis=1)
    rec["absmax"][:-1] = am
    rec["absmax"][-1] = 30.0
    rec["max"], rec["min"], rec["std"], rec["mean"] = rec["absmax"], -1.0, 1.0, 0.0
    first_bad = -1
    if step >= bad_from:
        start = 7 * 10 + 3 * 2 + 1 if step == bad_from else 1  # layer 7 down_proj output
        rec["nan_count"][start:] = 5
        first_bad = start
    st = np.zeros(1, schema.step_dtype())
    st["step"], st["t_start"], st["duration"], st["complete"] = step, 1e9 + step, 0.05, 1
    st["record_count"], st["first_call"], st["n_calls"] = n_rec, first_call, n_calls
    st["n_nonfinite_records"] = int((rec["nan_count"] > 0).sum())
    st["first_nonfinite_record"] = first_bad
    ob = (rec["nan_count"] > 0) & (rec["io"] == 1)
    st["first_nonfinite_call"] = int(rec["call_index"][np.argmax(ob)]) if ob.any() else -1
    st["token_count"] = tokens
    st["has_logits"] = 1
    st["logits_min"], st["logits_max"], st["logits_entropy"] = -20, 20 + rng.random(), 2.0
    st["logits_argmax"] = rng.integers(0, 32000)
    if step >= bad_from:
        st["logits_nan"] = 32000
        st["logits_argmax"] = -1
    return StepBatch(steps=st, records=rec, chan_min=cmin, chan_max=cmax, tok_absmax=tok,
                     input_ids=rng.integers(0, 32000, tokens))


def generate(path: str, size_gb: float) -> None:
    per_step = (LAYERS * 5 * 2) * CHANNELS * 4 * 2
    n_steps = max(2, int(size_gb * 1e9 / (per_step * 0.8)))  # gzip+shuffle keeps ~80%
    bad_from = int(n_steps * 0.8)
    w = TraceWriter(path, modules=modules(), environment={"rank": 0, "world_size": 1},
                    capture_options={"bench": True}, flush_interval=1.0)
    rng = np.random.default_rng(0)
    call = 0
    t0 = time.time()
    for s in range(n_steps):
        b = make_batch(rng, s, call, bad_from)
        call += LAYERS * 5 + 1
        w.submit(b)
        if s % 8 == 7:  # bound memory: at most 8 steps wait (a barrier, not a sleep)
            w.flush(timeout=None)
    w.close()
    print(f"wrote {path}: {n_steps} steps, {os.path.getsize(path) / 1e9:.2f} GB, NaN from step "
          f"{bad_from}, in {time.time() - t0:.0f} s", flush=True)


def _children_cpu() -> float:
    """User + system CPU seconds of finished child processes: what a run cost, whatever else
    the machine was doing (its wall time also counts waiting for a CPU on a shared machine)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", default=os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                   "qforensics-bench-1gb.h5"))
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--regenerate", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if args.regenerate or not os.path.exists(args.path):
        generate(args.path, args.size_gb)
    cmd = [sys.executable, "-c", "import sys; from qforensics.cli import main; main()",
           "analyze", args.path]
    times, cpus = [], []
    first = ""
    for _ in range(args.repeat):
        c0 = _children_cpu()
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        times.append(time.perf_counter() - t0)
        cpus.append(_children_cpu() - c0)
        first = r.stdout.splitlines()[0] if r.stdout else r.stderr[-500:]
        if r.returncode not in (0, 1):
            sys.exit(f"analyze failed (exit {r.returncode}): {r.stderr[-2000:]}")
    size = os.path.getsize(args.path) / 1e9
    print(first)
    print(f"qforensics analyze on {size:.2f} GB: best {min(times):.2f} s, "
          f"runs {', '.join(f'{t:.2f}' for t in times)} s (target <= 1 s); CPU time (user + "
          f"sys) of the runs {', '.join(f'{c:.2f}' for c in cpus)} s; load average "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    if sys.flags.dont_write_bytecode:
        print("(PYTHONDONTWRITEBYTECODE is set: qforensics' modules were compiled from source in "
              "each run, as an installed package's are not)")


if __name__ == "__main__":
    main()
