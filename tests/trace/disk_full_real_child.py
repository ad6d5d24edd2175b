"""Run by test_disk_full.py in a process of its own, on the real SmolLM2-135M (HF): greedy
TOKENS tokens under capture with defaults; from forward 45 on the trace file may grow at most
GROW bytes more (RLIMIT_FSIZE: EFBIG, as a full disk gives ENOSPC); row 5 of layer 17's v_proj
weight turns NaN before forward BAD. Prints what capture said of itself as JSON."""

from __future__ import annotations

import json
import os
import resource
import signal
import sys

import torch

import qforensics
from qforensics.demo.scenarios import DemoModel

grow, tokens, bad, path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the default already in CPython; said anyway
demo = DemoModel()
model = demo.model
forwards = [0]


def pre(module, args, kwargs):
    forwards[0] += 1
    if forwards[0] == 45:  # the ring (16 steps) has turned on disk: a drain is <= 1 s late
        size = os.path.getsize(path) + grow
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    if forwards[0] == bad:
        with torch.no_grad():
            model.model.layers[17].self_attn.v_proj.weight[5, :] = float("nan")


model.register_forward_pre_hook(pre, with_kwargs=True)
with torch.no_grad(), qforensics.capture(model, path) as cap:
    model.generate(input_ids=demo.input_ids, attention_mask=demo.attention_mask,
                   max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
print(json.dumps({"degraded": cap.degraded, "forwards": forwards[0]}))
