"""What reading one compiled step out of the ring costs on the host (`GraphStats.collect`), with
the channel ranges copied by fused_reduce.c's `qf_spans` against a slice per entry, side by
side in one run.

    python bench/collect_cost.py
    python bench/collect_cost.py --calls 500 --rounds 5

A CPU ring laid out as SmolLM2-135M's is (30 decoder layers, 16 entries each: 480 entries,
their channel ranges ~392k floats a step), every entry stamped with the step, so every entry
ran and every channel range is kept; no model is loaded. Rounds alternate the two paths, so
both see the same machine. Printed: this thread's CPU time per collect, per path, and the
ratio (slices / qf_spans).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# one decoder layer's entry widths (inputs and outputs of its hooked modules), SmolLM2's
LAYER = (576, 576, 576, 576, 576, 576, 576, 1536, 1536, 1536, 576, 576, 576, 576, 1536, 576)
LAYERS = 30
STEP = 3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200, help="timed collects per round and path")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)

    import torch

    from qforensics.hooks import fused, graphstats
    from qforensics.hooks.statsop import COL

    if not fused.REDUCER.ready():
        fused.REDUCER.wait()
    c_spans = fused.REDUCER.spans()
    if c_spans is None:
        sys.exit(f"fused_reduce.c is not loaded ({fused.REDUCER.off}): nothing to compare")
    gs = graphstats.GraphStats(entries=len(LAYER) * LAYERS, tok_rows=16,
                               device=torch.device("cpu"), channel_limit=8192,
                               channel_io="all")
    for i, w in enumerate(LAYER * LAYERS):
        gs.place(i // 2, i % 2, 0, w, 0, False)
    row = gs.segments[0][STEP % gs.slots]
    for e in gs.entries:  # one row of e.width channels, written at STEP
        row[e.off + COL["rows"]] = 1
        row[e.off + COL["channels"]] = e.width
        row[e.off + COL["stamp"]] = STEP
    part = gs.collect(STEP, 0, True)
    assert part is not None and len(part["records"]) == len(gs.entries)

    def timed(path: str) -> float:
        fused.REDUCER.spans = (lambda: c_spans) if path == "qf_spans" else (lambda: None)
        c0 = time.thread_time()
        for _ in range(a.calls):
            gs.collect(STEP, 0, True)
        return (time.thread_time() - c0) / a.calls * 1e3

    best = {"qf_spans": float("inf"), "slices": float("inf")}
    try:
        for _ in range(a.rounds):
            for path in best:
                best[path] = min(best[path], timed(path))
    finally:
        del fused.REDUCER.spans  # the bound method again
        gs.close()
    print(f"collect, {len(gs.entries)} entries, {len(part['cmin']):,} channels a step "
          f"(best of {a.rounds} rounds x {a.calls}):")
    for path, ms in best.items():
        print(f"  {path:<9} {ms:.3f} ms")
    print(f"  slices / qf_spans: {best['slices'] / best['qf_spans']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
