"""Regenerate the committed sample traces from the real SmolLM2-135M model.

    python sample_traces/regenerate.py            # all scenarios, ~2 minutes on 2 CPU cores

Greedy decoding on a fixed prompt on the CPU is deterministic; only timestamps differ between
runs. Capture options keep each file small: per-channel ranges as float16 for the prefill
(step 0) only, a 2 MiB snapshot budget with 64-row weight tiles.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from qforensics.demo.scenarios import run_scenarios
from qforensics.trace.writer import compact_trace

OPTIONS = {
    "channel_dtype": "float16",
    "channel_steps": "0",
    "snapshot_budget": 2 << 20,
    "snapshot_tile_rows": 64,
}
MAX_NEW_TOKENS = 24

if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    names = sys.argv[1:] or None
    for oc in run_scenarios(names, here, max_new_tokens=MAX_NEW_TOKENS, capture_options=OPTIONS,
                            progress=lambda m: print(m, file=sys.stderr)):
        fd, tmp = tempfile.mkstemp(suffix=".h5", dir=here)
        os.close(fd)
        compact_trace(oc.trace, tmp)
        os.replace(tmp, oc.trace)
        size = Path(oc.trace).stat().st_size
        print(f"{Path(oc.trace).name}: {size / 1e6:.2f} MB")
