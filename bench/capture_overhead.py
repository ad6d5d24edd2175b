"""Capture overhead on the real model: hooked / unhooked wall time on the same greedy decode.

    python bench/capture_overhead.py [--tokens 64] [--repeat 5] [--channel-steps all]

Runs SmolLM2-135M greedy for --tokens new tokens (EOS suppressed so every run has the same
length), alternating unhooked and hooked runs (every Linear, every decoder block and the logits
captured), and prints medians, the hooked/unhooked ratio of the generate call, the one-time
attach / close cost, trace bytes per step and the peak RSS increase over the run for both. Not a test: figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time

import torch

import qforensics
from qforensics.demo.model import load_model


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    def __enter__(self) -> "PeakRSS":
        self.base = rss()
        self.peak = self.base
        self._stop = False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop:
            self.peak = max(self.peak, rss())
            time.sleep(0.005)

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._t.join()
        self.peak = max(self.peak, rss())

    @property
    def delta(self) -> int:
        return self.peak - self.base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--channel-steps", default="all")
    ap.add_argument("--channel-dtype", default="float32")
    args = ap.parse_args()
    model, tok = load_model()
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True)

    def run() -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(**enc, max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                                  do_sample=False, pad_token_id=tok.eos_token_id)

    run()  # warm-up
    plain, hooked, rss_plain, rss_hooked, sizes = [], [], [], [], []
    attach, close = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            with PeakRSS() as m:
                t = time.perf_counter()
                ref = run()
                plain.append(time.perf_counter() - t)
            rss_plain.append(m.delta)
            path = os.path.join(tmp, f"t{i}.h5")
            with PeakRSS() as m:
                t = time.perf_counter()
                cap = qforensics.capture(model, path, channel_steps=args.channel_steps,
                                         channel_dtype=args.channel_dtype)
                cap.attach()
                attach.append(time.perf_counter() - t)
                t = time.perf_counter()
                got = run()
                hooked.append(time.perf_counter() - t)
                t = time.perf_counter()
                cap.close()
                close.append(time.perf_counter() - t)
            rss_hooked.append(m.delta)
            assert torch.equal(ref, got), "capture changed the model's output"
            sizes.append(os.path.getsize(path))
            with qforensics.open_trace(path) as tr:
                steps = tr.n_steps
    mp, mh = statistics.median(plain), statistics.median(hooked)
    print(f"model: SmolLM2-135M, {args.tokens} new tokens, {steps} steps, "
          f"torch threads {torch.get_num_threads()}, {args.repeat} runs each")
    print(f"unhooked median {mp:.3f} s  (runs: {', '.join(f'{x:.3f}' for x in plain)})")
    print(f"hooked   median {mh:.3f} s  (runs: {', '.join(f'{x:.3f}' for x in hooked)})")
    print(f"ratio hooked/unhooked: {mh / mp:.3f}  (per-run ratios: "
          f"{', '.join(f'{h / p:.2f}' for h, p in zip(hooked, plain))})")
    print(f"one-time cost per capture: attach {statistics.median(attach):.3f} s (module "
          f"descriptions, weight health, FP8 probe, file), close {statistics.median(close):.3f} s"
          " (drain + seal)")
    print(f"trace: {statistics.median(sizes) / steps / 1024:.1f} KiB per step "
          f"({statistics.median(sizes) / 2**20:.1f} MiB for {steps} steps, "
          f"channel_steps={args.channel_steps}, channel_dtype={args.channel_dtype})")
    print(f"peak RSS increase during a run: unhooked {statistics.median(rss_plain) / 2**20:.1f} "
          f"MiB, hooked {statistics.median(rss_hooked) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
