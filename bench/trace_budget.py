"""The trace's byte budget over an hour of serving, written through the real writer.

    python bench/trace_budget.py                      # vLLM SmolLM2 steps, 20 a second, 1 hour
    python bench/trace_budget.py --seconds 600 --max-mib 256
    python bench/trace_budget.py --seconds 60 --max-mib 24 --fail-at 20 --channels 25344 \
        --ring-chunk 4096                             # CI (tests/bench), seconds

Each step is a batch shaped like one captured vLLM decode step of SmolLM2 with 8 requests (as in
bench/writer_cost.py: 300 records, 253,440 channel values for the ring, 8 token rows; about 63 KB
appended a step), submitted to `TraceWriter` with a flush after each second's worth of steps,
as the writer's schedule does in a run. Time is simulated (the steps' t_start advance by 1/rate),
so an hour takes minutes. A non-finite step is planted early (`--fail-at`, default step 100),
long before the budget is reached. One run prints:

  bytes/step     the file's growth per step while full detail is appended (steady state, from
                 the 10th to the 90th percent of that phase), and after the budget is reached
  file size      every simulated 10 minutes, and at the end, against the budget
  analyze        the verdict on the final file: the planted failure must be found (step, module)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from writer_cost import make_batch  # noqa: E402

from qforensics.analyze import analyze_trace  # noqa: E402
from qforensics.trace import schema  # noqa: E402
from qforensics.trace.writer import TraceWriter  # noqa: E402

N_MOD = 150


def _plant(b, step: int) -> None:
    """The output of module 40 (and everything after it) holds a NaN in this step."""
    rec = b.records
    bad = np.nonzero((rec["module_id"] > 40) | ((rec["module_id"] == 40) & (rec["io"] == 1)))[0]
    rec["nan_count"][bad] = 1
    s = b.steps
    s["n_nonfinite_records"], s["first_nonfinite_record"] = len(bad), int(bad[0])
    s["first_nonfinite_call"], s["logits_nan"] = int(rec["call_index"][bad[0]]), 1
    b.triggers = np.zeros(1, schema.trigger_dtype())
    b.triggers["step"], b.triggers["kind"], b.triggers["kept"] = step, b"nonfinite", 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=3600.0, help="simulated serving time")
    ap.add_argument("--rate", type=int, default=20, help="engine steps a second")
    ap.add_argument("--max-mib", type=float, default=1024.0, help="the budget (default 1 GiB)")
    ap.add_argument("--fail-at", type=int, default=100, help="the step planted non-finite")
    ap.add_argument("--channels", type=int, default=253_440,
                    help="channel values a step keeps in the ring (smaller: a smaller ring and "
                         "pinned windows, so that a small budget holds them; tests/bench)")
    ap.add_argument("--ring-chunk", type=int, default=65536,
                    help="channel values a ring chunk holds (the writer's budget estimate)")
    a = ap.parse_args()
    n = int(a.seconds * a.rate)
    budget = int(a.max_mib * (1 << 20))
    proto = [make_batch(i, 300, a.channels, 8) for i in range(4)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "hour.h5"
        mods = [{"name": f"model.layers.{i}.proj", "kind": "linear"} for i in range(N_MOD)]
        w = TraceWriter(path, modules=mods + [{"name": "", "kind": "root"}],
                        environment={"bench": "trace_budget"}, capture_options={
                            "trigger_window": 8, "snapshot_budget": 64 << 20},
                        ring_slots=16, ring_chunk=a.ring_chunk, max_bytes=budget)
        sizes: list[tuple[int, int]] = []
        t0 = time.perf_counter()
        for s in range(n):
            p = proto[s % len(proto)]
            b = type(p)(**{**p.__dict__, "steps": p.steps.copy(), "records": p.records.copy()})
            b.steps["step"], b.records["step"] = s, s
            b.steps["t_start"], b.steps["duration"] = s / a.rate, 0.8 / a.rate
            b.steps["complete"] = b.steps["has_logits"] = 1
            b.steps["logits_argmax"] = 100 + s % 997
            b.records["call_index"] = s * 300 + np.arange(300)
            if s == a.fail_at:
                _plant(b, s)
            w.submit(b)
            if s % a.rate == a.rate - 1:
                w.flush()
                sizes.append((s, os.path.getsize(path)))
        w.close()
        wall = time.perf_counter() - t0
        final = os.path.getsize(path)
        cap = w.capped_at if w.capped_at is not None else n
        pre = [(s, z) for s, z in sizes if s < cap]
        lo, hi = pre[len(pre) // 10], pre[max(len(pre) // 10, len(pre) * 9 // 10 - 1)]
        per_step = (hi[1] - lo[1]) / max(1, hi[0] - lo[0])
        post = [(s, z) for s, z in sizes if s > cap + a.rate]
        after = (post[-1][1] - post[0][1]) / max(1, post[-1][0] - post[0][0]) if len(post) > 1 \
            else float("nan")
        print(f"{n} steps ({a.seconds / 3600:.2f} h at {a.rate} steps/s), budget "
              f"{budget / 2**20:.0f} MiB, written in {wall:.0f} s")
        print(f"bytes/step while full detail is appended: {per_step / 1024:.1f} KiB "
              f"(steps {lo[0]}-{hi[0]})")
        at_cap = pre[-1][1] if pre else 0
        print(f"full detail stopped at step {w.capped_at} (file {at_cap / 2**20:.1f} MiB); "
              f"bytes/step after: {after:.1f}")
        every = max(1, int(600 * a.rate))
        for s, z in sizes:
            if (s + 1) % every == 0:
                print(f"  t = {(s + 1) / a.rate / 60:5.0f} min  step {s + 1:>7}  "
                      f"{z / 2**20:8.1f} MiB")
        print(f"file size at the end: {final / 2**20:.1f} MiB of {budget / 2**20:.0f} MiB "
              f"({'within' if final <= budget else 'OVER'} the budget)")
        f = analyze_trace(path)
        print(f"analyze: {f.verdict.line[:400]}")
        ok = f.first_nonfinite is not None and f.first_nonfinite.step == a.fail_at
        print(f"planted failure at step {a.fail_at} found: {ok}"
              + (f" (producer {f.first_nonfinite.module})" if ok else ""))


if __name__ == "__main__":
    main()
