"""Capture overhead on the real model, side by side in one run.

    python bench/capture_overhead.py [--tokens 64] [--rounds 4] [--no-nnsight]
    python bench/capture_overhead.py --random --device cuda --dtype bfloat16 --no-nnsight

With `--random` the model is SmolLM2's architecture with random weights (bench/compiled_capture.py
`build`, `--layers N` to keep N layers) on a fixed prompt: what a GPU machine without the GGUF
runs (scripts/gpu_session.sh). On a GPU each timed call ends with a device synchronize.

Runs SmolLM2-135M greedy for --tokens new tokens (EOS suppressed so every run has the same
length) under inference_mode, and times, interleaved round by round on the same prompt:

  plain      generation with no hooks
  bare       one forward pre-hook per Linear keeping the input's per-channel absmax on the device
  nnsight    nnsight (optional: pip install -e ".[bench]") saving the same per-channel absmax
  qf-default qforensics.capture with its defaults (every Linear, every decoder block, logits):
             every hook calls the stats op (hooks/statsop.py) into the device ring, as
             compiled mode does (on the CPU through hooks/opcall.c)
  qf-scalar  qforensics.capture(channel_steps="none"): scalars and per-token maxima only

and prints the median time of each, its ratio to plain, trace KiB per step and the peak RSS
increase during a run (and torch.cuda.max_memory_allocated when on a GPU). Every hooked run's
tokens are checked against plain generation's. Not a test: figures depend on the machine and its
load; run it once, on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Callable

import h5py
import torch

import qforensics
from qforensics.demo.model import load_model


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Peak resident set size while the block runs (sampled every 20 ms)."""

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
            time.sleep(0.02)

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._t.join()
        self.peak = max(self.peak, rss())

    @property
    def delta(self) -> int:
        return self.peak - self.base


def linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def smollm2_generation(tokens: int) -> tuple[torch.nn.Module, Any, Any, dict[str, Any]]:
    """The real SmolLM2, its tokenizer, its chat prompt and greedy `generate` arguments for
    `tokens` tokens (shared with bench/hf_step_profile.py)."""
    model, tok = load_model()
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    gen = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
               pad_token_id=tok.eos_token_id)
    return model, tok, enc, gen


def random_generation(args: argparse.Namespace
                      ) -> tuple[torch.nn.Module, None, dict[str, torch.Tensor], dict[str, Any]]:
    """SmolLM2's architecture with random weights on `args.device`, a fixed prompt and the same
    greedy arguments as `smollm2_generation` (EOS suppressed)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import compiled_capture

    model, ids, _ = compiled_capture.build(args)
    x = torch.tensor([ids], device=args.device)
    enc = {"input_ids": x, "attention_mask": torch.ones_like(x)}
    gen = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
               pad_token_id=0)
    return model, None, enc, gen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--no-nnsight", action="store_true", help="skip the nnsight row")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--random", action="store_true",
                    help="SmolLM2's architecture with random weights, not the real model")
    ap.add_argument("--layers", type=int, default=0, help="keep the first N layers (0: all)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.random:
        model, tok, enc, gen = random_generation(args)
        args.no_nnsight = True  # nnsight's LanguageModel wants a tokenizer
    else:
        model, tok, enc, gen = smollm2_generation(args.tokens)
    on_gpu = torch.device(args.device).type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    tmp = tempfile.TemporaryDirectory()
    sizes: dict[str, list[float]] = {}
    rings: dict[str, list[float]] = {}

    def generate() -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(**enc, **gen)

    # each variant: () -> (timed generate, untimed teardown)
    Variant = Callable[[], tuple[Callable[[], torch.Tensor], Callable[[], None]]]

    def plain() -> tuple[Callable[[], torch.Tensor], Callable[[], None]]:
        return generate, lambda: None

    def bare() -> tuple[Callable[[], torch.Tensor], Callable[[], None]]:
        kept: list[torch.Tensor] = []

        def pre(mod: Any, a: tuple) -> None:
            x = a[0]
            kept.append(x.abs().amax(dim=tuple(range(x.dim() - 1))))

        hs = [m.register_forward_pre_hook(pre) for m in linears(model)]

        def done() -> None:
            for h in hs:
                h.remove()
        return generate, done

    def qf(name: str, **opts: Any) -> Variant:
        def setup() -> tuple[Callable[[], torch.Tensor], Callable[[], None]]:
            path = os.path.join(tmp.name, f"{name}.h5")
            cap = qforensics.capture(model, path, **opts)
            cap.attach()  # module descriptions, weight health, file: once per run, untimed

            def done() -> None:
                cap.close()
                with qforensics.open_trace(path) as t:
                    steps = t.n_steps
                with h5py.File(path, "r") as f:  # the ring's fixed size, not per step
                    ring = sum(f[p].id.get_storage_size() for p in ("ring/min", "ring/max"))
                size = os.path.getsize(path)
                sizes.setdefault(name, []).append(size / max(steps, 1) / 1024)
                rings.setdefault(name, []).append(ring / 2**20)
                os.remove(path)
            return generate, done
        return setup

    runners: dict[str, Variant] = {"plain": plain, "bare": bare}
    nn_note = ""
    if not args.no_nnsight:
        try:
            import warnings

            from nnsight import LanguageModel

            warnings.filterwarnings("ignore", module="nnsight")
            lm = LanguageModel(model, tokenizer=tok)
            lm_lins = [m for _, m in lm.named_modules()
                       if isinstance(getattr(m, "_module", None), torch.nn.Linear)]

            def nns_run() -> torch.Tensor:
                with torch.inference_mode():
                    with lm.generate(enc["input_ids"], attention_mask=enc["attention_mask"],
                                     **gen) as tracer:
                        out = lm.generator.output.save()  # before the unbounded loop below
                        kept = list().save()
                        with tracer.all():
                            for m in lm_lins:
                                kept.append(m.input.abs().amax(dim=(0, 1)))
                return out

            runners["nnsight"] = lambda: (nns_run, lambda: None)
        except ImportError as exc:
            nn_note = f"nnsight: not installed here ({exc}); pip install -e '.[bench]'"
    runners["qf-default"] = qf("qf-default")
    runners["qf-scalar"] = qf("qf-scalar", channel_steps="none")

    ref = generate()
    for setup in runners.values():  # warm-up, and every variant must generate the same tokens
        fn, done = setup()
        got = fn()
        done()
        assert torch.equal(ref, got), "a hooked run changed the generated tokens"
    from qforensics.hooks import fused, opcall  # built off-thread, once

    fused.REDUCER.wait()
    opcall.LANE.wait()  # the eager op calls without the dispatcher (hooks/opcall.py)
    print(f"the CPU kernels: {fused.REDUCER.status()['reduction']}; the op's eager "
          f"lane: {'off (' + opcall.LANE.off + ')' if opcall.LANE.off else 'c'}",
          file=sys.stderr)
    sizes.clear()
    rings.clear()
    times: dict[str, list[float]] = {k: [] for k in runners}
    cpu: dict[str, list[float]] = {k: [] for k in runners}
    peaks: dict[str, list[int]] = {k: [] for k in runners}
    for r in range(args.rounds):
        names = list(runners)
        names = names[r % len(names):] + names[:r % len(names)]  # rotate the order
        for name in names:
            fn, done = runners[name]()
            with PeakRSS() as m:
                sync()
                t, c = time.perf_counter(), time.process_time()
                fn()
                sync()
                times[name].append(time.perf_counter() - t)
                cpu[name].append(time.process_time() - c)
            done()
            peaks[name].append(m.delta)
    base = statistics.median(times["plain"])
    base_cpu = statistics.median(cpu["plain"])
    what = (f"SmolLM2's architecture, random weights, {model.config.num_hidden_layers} layers, "
            f"{args.device} {args.dtype}" if args.random else "SmolLM2-135M")
    print(f"{what}, {args.tokens} greedy tokens, every Linear, {args.rounds} interleaved "
          f"rounds, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("ratio: median wall time / plain's; cpu ratio: median process CPU time / plain's "
          "(steadier on a shared machine); generate only (attach and close untimed)")
    print(f"{'what runs':<12}{'wall s':>8}{'ratio':>7}{'cpu s':>8}{'cpu ratio':>10}"
          f"{'KiB/step':>10}{'peak RSS +MiB':>15}")
    for name in runners:
        med, mc = statistics.median(times[name]), statistics.median(cpu[name])
        kib = f"{statistics.median(sizes[name]):.1f}" if name in sizes else "-"
        print(f"{name:<12}{med:>8.3f}{med / base:>7.3f}{mc:>8.3f}{mc / base_cpu:>10.3f}{kib:>10}"
              f"{statistics.median(peaks[name]) / 2**20:>15.1f}")
    for name in (n for n in rings if statistics.median(rings[n]) > 0):
        print(f"{name}: KiB/step includes the fixed ring of the last steps' channel ranges, "
              f"{statistics.median(rings[name]):.1f} MiB here (at most ring_steps slots, whatever "
              "the length of the run)")
    if nn_note:
        print(nn_note)
    if torch.cuda.is_available():
        print(f"cuda max_memory_allocated: {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")
    tmp.cleanup()


if __name__ == "__main__":
    main()
