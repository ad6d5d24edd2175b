"""Trace size of a long generation on the real model, with capture defaults.

    python bench/trace_size.py [--tokens 1000] [--channel-steps auto]

Runs SmolLM2-135M greedy for --tokens new tokens (EOS suppressed) under qforensics.capture and
prints the file size, KiB per step, and where the bytes are: the fixed ring, per-channel ranges
kept for good, everything else (records, tokens, logits). Not a test; one run takes minutes.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import h5py
import torch

import qforensics
from qforensics.demo.model import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--channel-steps", default="auto")
    args = ap.parse_args()
    model, tok = load_model()
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "long.h5")
        t0 = time.perf_counter()
        with qforensics.capture(model, path, channel_steps=args.channel_steps):
            with torch.inference_mode():
                model.generate(**enc, max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                               do_sample=False, pad_token_id=tok.eos_token_id)
        took = time.perf_counter() - t0
        size = os.path.getsize(path)
        with qforensics.open_trace(path) as t:
            steps = t.n_steps
            kept_steps = len(t.triggers)
        with h5py.File(path, "r") as f:
            ring = sum(f[p].id.get_storage_size() for p in ("ring/min", "ring/max"))
            chans = sum(f[p].id.get_storage_size() for p in ("channels/min", "channels/max"))
    print(f"SmolLM2-135M, {args.tokens} greedy tokens, channel_steps={args.channel_steps}: "
          f"{steps} steps in {took:.0f} s")
    print(f"trace {size / 2**20:.1f} MiB = {size / steps / 1024:.1f} KiB per step; ring "
          f"{ring / 2**20:.1f} MiB (fixed), channels kept for good {chans / 2**20:.1f} MiB, "
          f"the rest {(size - ring - chans) / steps / 1024:.1f} KiB per step; "
          f"{kept_steps} trigger rows")


if __name__ == "__main__":
    main()
