"""What the trace writer costs the run it records, per second of that run.

    python bench/writer_cost.py                       # a vLLM SmolLM2 decode step's batch
    python bench/writer_cost.py --records 480 --channels 400000 --step-ms 45 190

The writer runs on the model's thread (trace/writer.py): every write appends each column
dataset once and flushes the file, a fixed cost, plus each step's ring slot. This benchmark
builds batches shaped like one captured decode step (default: SmolLM2 in vLLM, 8 requests:
300 records, 253,440 channel values in the ring, 8 token rows), then for each step length:

  writes/s     how often the schedule writes: driven through `TraceWriter.submit` with a
               simulated clock, against the earlier rule (a write every flush_interval / 2);
  ms/write     a write's cost (appends + flush) at that many steps per write, measured on a
               real file, with gzip level 4 (before) and 1 (now) on the integer columns;
  writer ms/s  the product, plus the ring: the writer's share of one second of the run,
               before and after, and their ratio.

One run prints all of it; the figures are this machine's.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from qforensics.trace import schema  # noqa: E402
from qforensics.trace import writer as writer_mod  # noqa: E402
from qforensics.trace import layout as layout_mod  # noqa: E402
from qforensics.trace.writer import StepBatch, TraceWriter  # noqa: E402


def make_batch(step: int, records: int, channels: int, rows: int) -> StepBatch:
    rng = np.random.default_rng(step)
    st = np.zeros(1, schema.step_dtype())
    st["step"], st["record_count"], st["token_count"] = step, records, rows
    st["first_nonfinite_call"] = st["first_nonfinite_record"] = -1
    rec = np.zeros(records, schema.record_dtype())
    rec["step"] = step
    rec["call_index"] = np.arange(records) + step * records
    rec["module_id"] = np.arange(records) // 2
    rec["io"] = np.arange(records) % 2
    rec["flags"] = schema.FLAG_RING
    rec["channels"] = channels // records
    rec["chan_offset"] = np.arange(records) * (channels // records)
    rec["tok_offset"], rec["tok_count"] = np.arange(records) * rows, rows
    for col in ("min", "max", "mean", "std", "absmax"):
        rec[col] = rng.standard_normal(records)
    engine = {t: np.zeros(rows if t == "rows" else 1, schema.engine_dtype(t))
              for t in schema.ENGINE_TABLES}
    return StepBatch(steps=st, records=rec,
                     chan_min=rng.standard_normal(channels).astype(np.float32),
                     chan_max=rng.standard_normal(channels).astype(np.float32),
                     tok_absmax=rng.random(records * rows).astype(np.float32),
                     input_ids=np.arange(rows), engine=engine, ring=True)


def _writer(path: Path, ring_chunk: int) -> TraceWriter:
    return TraceWriter(path, modules=[{"name": f"m{i}"} for i in range(150)], environment={},
                       capture_options={}, ring_slots=16, ring_chunk=ring_chunk)


def writes_per_second(step_s: float, seconds: float, batch: StepBatch) -> float:
    """Drive the schedule with a simulated clock (no real time passes): writes per second."""
    now = [0.0]
    real_clock = writer_mod._clock
    writer_mod._clock = lambda: now[0]
    with tempfile.TemporaryDirectory() as tmp:
        w = _writer(Path(tmp) / "s.h5", 4096)
        n = [0]
        w._write = lambda batches: n.__setitem__(0, n[0] + 1)  # count, don't write
        try:
            for _ in range(int(seconds / step_s)):
                now[0] += step_s
                w.submit(batch)
        finally:
            writer_mod._clock = real_clock
            w._write = lambda batches: None
            w.close()
    return n[0] / seconds


def write_cost(level: int, per_write: int, batches: list[StepBatch], ring_chunk: int
               ) -> tuple[float, float, float]:
    """(ms per write without its ring slots, ms per ring slot, bytes per step) on a real file."""
    saved = layout_mod._COMPRESSION
    layout_mod._COMPRESSION = {**saved, "compression_opts": level}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            w = _writer(Path(tmp) / "c.h5", ring_chunk)
            ring_ns = [0]
            real_ring = w._write_ring

            def timed_ring(b, _real=real_ring):
                t = time.perf_counter_ns()
                _real(b)
                ring_ns[0] += time.perf_counter_ns() - t

            w._write_ring = timed_ring
            groups = [batches[i:i + per_write] for i in range(0, len(batches), per_write)]
            with w._drain:  # the writer thread stays out of it
                t0 = time.perf_counter_ns()
                for g in groups:
                    w._write(g)
                total = time.perf_counter_ns() - t0
            w.close()
            size = os.path.getsize(Path(tmp) / "c.h5")
    finally:
        layout_mod._COMPRESSION = saved
    return ((total - ring_ns[0]) / 1e6 / len(groups), ring_ns[0] / 1e6 / len(batches),
            size / len(batches))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=300, help="records per step")
    ap.add_argument("--channels", type=int, default=253_440, help="channel values per step")
    ap.add_argument("--rows", type=int, default=8, help="token rows per step")
    ap.add_argument("--step-ms", type=float, nargs="+", default=[45.0, 190.0],
                    help="step lengths to evaluate (ms)")
    ap.add_argument("--steps", type=int, default=120, help="steps written per measurement")
    ap.add_argument("--ring-chunk", type=int, default=65536)
    a = ap.parse_args()
    batches = [make_batch(i, a.records, a.channels, a.rows) for i in range(a.steps)]
    print(f"batch: {a.records} records, {a.channels} channel values, {a.rows} token rows; "
          f"flush_interval 1 s")
    for step_ms in a.step_ms:
        d = step_ms / 1e3
        before_wps = 1.0 / (math.ceil(0.5 / d) * d)  # a write at the first step end past 0.5 s
        now_wps = writes_per_second(d, 60.0, batches[0])
        per_before = max(1, round(1 / (before_wps * d)))
        per_now = max(1, round(1 / (now_wps * d)))
        w4, ring4, size4 = write_cost(4, per_before, batches, a.ring_chunk)
        w1, ring1, size1 = write_cost(1, per_now, batches, a.ring_chunk)
        before = before_wps * w4 + ring4 / d
        now = now_wps * w1 + ring1 / d
        print(f"step {step_ms:.0f} ms:")
        print(f"  writes/s     before {before_wps:.2f} ({per_before} steps a write), now "
              f"{now_wps:.2f} ({per_now} steps a write)")
        print(f"  ms/write     before {w4:.2f} (gzip 4), now {w1:.2f} (gzip 1); ring "
              f"{ring4:.2f} / {ring1:.2f} ms a step")
        print(f"  file         before {size4 * len(batches) / 1e6:.2f} MB, now "
              f"{size1 * len(batches) / 1e6:.2f} MB ({len(batches)} steps, the ring's fixed "
              f"{2 * 16 * a.channels * 4 / 1e6:.1f} MB included)")
        print(f"  writer ms/s  before {before:.1f}, now {now:.1f}: ratio now/before "
              f"{now / before:.2f} ({before / 10:.2f}% -> {now / 10:.2f}% of the run)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
