"""Run by test_disk_full.py in a process of its own: a capture whose file may not grow more
than GROW bytes past its size at step 50 (RLIMIT_FSIZE: the kernel fails the writes past it
with EFBIG, as a full disk fails them with ENOSPC), with a NaN put into layers.1.down's weight
before step BAD (-1: never). Prints what capture said of itself as JSON."""

from __future__ import annotations

import json
import os
import resource
import signal
import sys

import torch

import qforensics
from capture_models import Tiny

grow, steps, bad, path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
# "compiled": torch.compile'd, each step re-feeding its sequence plus one token, so that its
# steps are decodes whose channel ranges go to the ring (left in the op's ring until needed)
compiled = "compiled" in sys.argv[5:]
# "at_close": no drain of its own after step 50 (a flush interval longer than the run), so the
# steps from there on are written in the one drain at close, which the limit cuts mid-flush
at_close = "at_close" in sys.argv[5:]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of a kill
m = Tiny()
with torch.no_grad():
    m.head.weight.mul_(30)  # confident logits: a healthy run here reads as one
gen = torch.Generator().manual_seed(1)
model = torch.compile(m, dynamic=True) if compiled else m
seq = torch.randint(0, 16, (1, 6), generator=gen)
with torch.no_grad(), qforensics.capture(model, path,
                                            flush_interval=1e4 if at_close else 0.01) as cap:
    for i in range(steps):
        if i == 50:  # the ring has turned: its chunks are on disk once the writer has
            # written what was emitted so far (a barrier: a loaded machine's writer lags)
            assert cap._writer.flush(120), "the writer did not catch up"
            size = os.path.getsize(path) + grow
            resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        if i == bad:
            m.layers[1].down.weight[3, 2] = float("nan")
        if compiled:
            model(seq)
            seq = torch.cat([seq, torch.randint(0, 16, (1, 1), generator=gen)], 1)
        else:
            model(torch.randint(0, 16, (1, 6), generator=gen))
print(json.dumps({"degraded": cap.degraded}))
