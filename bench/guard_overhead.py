"""Guard overhead and repair quality on the real SmolLM2-135M (CPU is fine).

    python bench/guard_overhead.py [--repeats 5] [--max-new-tokens 32]

1. Overhead on a run with no trips: the unquantized reference generating greedily, without the
   guard and under it (check="logits", the default, and check="modules"), interleaved, median
   of --repeats runs each; also one teacher-forced forward (a long prefill-like step).
   Prints guarded / unguarded wall-time ratios.
2. Repair: the fp8-e4m3-nosat-act scenario (every Linear but lm_head quantizes its input to
   FP8 e4m3 without saturation) without and with the guard: generated text, NaN, guard stats,
   and the teacher-forced top-1 agreement with the reference continuation (as
   qforensics.demo.scenarios.DemoModel.teacher_forced_top1 measures it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import qforensics
from qforensics.quant import emulate_quantized_linears
from qforensics.whatif.run import demo_prompt_ids, load_demo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args()
    torch.manual_seed(0)
    model, tok = load_demo()
    ids = demo_prompt_ids(tok)
    n = ids.shape[1]

    def generate(max_new: int = args.max_new_tokens, force: bool = True):
        """Greedy; ``force``: no stop at EOS, so every timed run has the same length."""
        with torch.inference_mode():
            return model.generate(ids, attention_mask=torch.ones_like(ids),
                                  max_new_tokens=max_new, do_sample=False, temperature=None,
                                  top_p=None, top_k=None, pad_token_id=tok.eos_token_id,
                                  min_new_tokens=max_new if force else None)

    def forward(full):
        with torch.inference_mode():
            return model(full).logits[0]

    ref = generate()  # timing input: forced to the full length
    nat = generate(force=False)  # the reference answer (stops at EOS): agreement is on this
    print(f"reference answer: {tok.decode(nat[0, n:].tolist())!r} ({nat.shape[1] - n} tokens)")

    # 1. overhead, no trips ------------------------------------------------------------------
    modes = {"unguarded": None, "guard check=logits": "logits", "guard check=modules": "modules"}
    gen_t: dict[str, list[float]] = {k: [] for k in modes}
    fwd_t: dict[str, list[float]] = {k: [] for k in modes}
    generate(4)  # warm-up
    for _ in range(args.repeats):
        for label, check in modes.items():
            g = qforensics.guard(model, check=check) if check else None
            if g:
                g.attach()
            try:
                t0 = time.perf_counter()
                generate()
                gen_t[label].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                forward(ref)
                fwd_t[label].append(time.perf_counter() - t0)
                if g:
                    assert g.stats.trips == 0 and g.stats.sanitized_steps == 0
            finally:
                if g:
                    g.close()
    base_g = statistics.median(gen_t["unguarded"])
    base_f = statistics.median(fwd_t["unguarded"])
    print(f"\noverhead, no trips (median of {args.repeats}; guarded / unguarded wall time):")
    for label in modes:
        mg, mf = statistics.median(gen_t[label]), statistics.median(fwd_t[label])
        print(f"  {label:22s} generate {args.max_new_tokens} tokens: {mg:6.3f}s  "
              f"ratio {mg / base_g:.3f}   |   one {ref.shape[1]}-token forward: {mf:6.3f}s  "
              f"ratio {mf / base_f:.3f}")

    # 2. repair of the fp8-e4m3-nosat activation scenario --------------------------------------
    ref_tokens = nat[0, n:]
    with emulate_quantized_linears(model, "fp8-e4m3-nosat", exclude=("lm_head",)):
        t0 = time.perf_counter()
        bad = generate(force=False)
        t_bad = time.perf_counter() - t0
        lg = forward(nat)
        agree_bad = float((lg[n - 1:-1].argmax(-1) == ref_tokens).float().mean())
        print(f"\nfp8-e4m3-nosat-act without guard ({t_bad:.1f}s): NaN logits: "
              f"{bool(torch.isnan(lg).any())}; text {tok.decode(bad[0, n:].tolist())[:80]!r}; "
              f"top-1 agreement {100 * agree_bad:.1f}%")
        with qforensics.guard(model) as g:
            t0 = time.perf_counter()
            good = generate(force=False)
            t_good = time.perf_counter() - t0
            gen_stats = g.stats.as_dict()
            lg = forward(nat)
        agree = float((lg[n - 1:-1].argmax(-1) == ref_tokens).float().mean())
        print(f"fp8-e4m3-nosat-act with guard ({t_good:.1f}s): finite logits: "
              f"{bool(torch.isfinite(lg).all())}; text {tok.decode(good[0, n:].tolist())[:80]!r}")
        print(f"  teacher-forced top-1 agreement with the reference: {100 * agree:.1f}% "
              f"({int(ref_tokens.numel())} positions)")
        same = good.shape == nat.shape and bool((good == nat).all())
        print(f"  guarded greedy answer identical to the reference: {same}")
        print(f"  guard stats (generate): trips {gen_stats['trips']} "
              f"{gen_stats['trips_by_module']}, reruns {gen_stats['reruns']}, repaired steps "
              f"{gen_stats['repaired_steps']}, sanitized steps {gen_stats['sanitized_steps']}, "
              f"breakers open {gen_stats['breakers_open']}, host syncs "
              f"{gen_stats['host_syncs']} over {gen_stats['steps']} steps")


if __name__ == "__main__":
    main()
