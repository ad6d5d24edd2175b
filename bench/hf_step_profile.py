"""Where a captured HF decode step's time goes (SmolLM2-135M, `generate`, one thread).

    python bench/hf_step_profile.py            # 64 greedy tokens
    python bench/hf_step_profile.py --tokens 128 --threads 2

Times one plain `generate` and one under `qforensics.capture` (each after a warm-up call), then
prints the ratio and, per captured step, the time spent in capture's main functions
(bench/step_timers.py: each wrapped call costs about a microsecond more, so the timed ratio is an
upper bound; bench/capture_overhead.py measures the ratio without timers).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_timers import profile, report  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    if a.tokens < 2:
        ap.error("--tokens must be at least 2")
    spent, calls = profile()
    import torch
    from capture_overhead import smollm2_generation

    import qforensics

    torch.set_num_threads(a.threads)
    model, _tok, enc, gen = smollm2_generation(a.tokens)

    def timed() -> float:
        with torch.inference_mode():
            model.generate(**enc, **gen)  # warm-up (and the step plans, when captured)
            spent.clear()
            calls.clear()
            t0 = time.perf_counter()
            model.generate(**enc, **gen)
            return time.perf_counter() - t0

    plain = timed()
    with tempfile.TemporaryDirectory() as tmp:
        cap = qforensics.capture(model, str(Path(tmp) / "t.h5"))
        cap.attach()
        try:
            captured = timed()
        finally:
            cap.close()
    steps = calls.get("CallHooks._on_root_pre", 0)
    print(f"SmolLM2-135M, {a.tokens} greedy tokens, {a.threads} thread(s): plain {plain:.3f} s "
          f"({plain / a.tokens * 1e3:.1f} ms a step), captured with timers {captured:.3f} s, "
          f"ratio {captured / plain:.3f}")
    if steps:
        print(f"where a captured step's time went ({steps} steps):")
        report(spent, calls, steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
