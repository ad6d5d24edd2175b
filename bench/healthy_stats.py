"""The statistic of every silent (SUSPECT) output rule on healthy runs of the real, unquantized
SmolLM2-135M: what docs/thresholds.md's table comes from.

    python bench/healthy_stats.py --hf-tokens 400               # HF: 8 greedy + 4 sampled runs
    .venv-vllm/bin/python bench/healthy_stats.py --vllm --hf-tokens 0   # + vLLM eager 8 x 400
    python bench/healthy_stats.py --traces a.h5 b.h5            # measure existing traces

For each trace it prints `rule_statistics` (qforensics/analyze/precursors.py: the value each
rule holds against its threshold, at its worst over the run and over the requests) and the
verdict; then the largest value of each statistic over all the healthy runs, next to the
threshold it must stay below.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path

PROMPTS = [
    "The capital of France is",
    "Quantization of large language models means",
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics state that",
    "def fibonacci(n):",
    "A recipe for a simple tomato soup:",
    "The history of the Roman Empire began",
    "Photosynthesis is the process by which",
]


def run_hf(out: Path, tokens: int, greedy: int, sampled: int) -> list[Path]:
    """One capture per prompt: greedy (no EOS stop: min_new_tokens) and sampled (T 0.8,
    top-p 0.95, seeded)."""
    import torch

    import qforensics
    from qforensics.demo.model import load_model

    model, tok = load_model()
    paths = []
    for mode, n in (("greedy", greedy), ("sample", sampled)):
        for i in range(n):
            ids = tok(PROMPTS[i % len(PROMPTS)], return_tensors="pt").input_ids
            path = out / f"hf-{mode}-{i}.h5"
            torch.manual_seed(i)
            kw = (dict(do_sample=False) if mode == "greedy" else
                  dict(do_sample=True, temperature=0.8, top_p=0.95, top_k=0))
            with qforensics.capture(model, path):
                model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens,
                               pad_token_id=tok.eos_token_id, **kw)
            paths.append(path)
            print(f"  ran {path.name}", file=sys.stderr, flush=True)
    return paths


def run_vllm(out: Path, tokens: int) -> list[Path]:
    """`qforensics record --eager -- vllm_serve` of the 8 prompts, greedy, `tokens` each."""
    from qforensics.demo.vllm_model import vllm_model_dir
    from qforensics.demo.vllm_scenarios import record_vllm

    d = out / "vllm"
    d.mkdir(parents=True, exist_ok=True)
    p = record_vllm(vllm_model_dir(), str(d / "t-{rank}.h5"), PROMPTS, tokens,
                    d / "outputs.json", cwd=d, extra=["--eager"])
    if p.returncode != 0:
        raise SystemExit(f"vLLM run failed:\n{p.stderr[-3000:]}")
    return sorted(d.glob("t-*.h5"))


def measure(path: Path) -> tuple[dict[str, float], str]:
    import numpy as np

    from qforensics.analyze import analyze_trace
    from qforensics.analyze.engine import warmup_steps, without_warmup
    from qforensics.analyze.precursors import rule_statistics, summary_owners
    from qforensics.analyze.thresholds import Thresholds
    from qforensics.trace.reader import open_trace

    f = analyze_trace(path)
    with open_trace(path) as t:
        steps = without_warmup(t.step_table, warmup_steps(t))
        stats = rule_statistics(steps, _vocab(t), Thresholds(),
                                summary_owners(t, steps))
        stats["steps"] = float(len(steps))
        stats["entropy_median"] = float(np.nanmedian(steps["logits_entropy"]))
    return stats, f.verdict.line


def _vocab(trace) -> int | None:
    import numpy as np

    from qforensics.formats import KIND_ROOT
    from qforensics.trace import schema

    recs = trace.record_table(int(trace.step_table["step"][-1]))
    kinds = trace.module_kinds
    root = np.nonzero((kinds[recs["module_id"]] == KIND_ROOT)
                      & (recs["io"] == schema.IO_OUTPUT))[0]
    return int(recs["channels"][root[0]]) if len(root) else None


# statistic -> (threshold field, how the rule compares)
LIMITS = {
    "growth_factor": ("logits_growth_factor", ">="),
    "collapse_scale": ("collapse_scale", ">="),
    "repeat_scale": ("collapse_scale", ">="),
    "uniform_share": ("entropy_uniform", ">="),
    "extreme_logit": ("logits_extreme", ">="),
    "degenerate_steps": ("degenerate_steps", ">="),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf-tokens", type=int, default=400)
    ap.add_argument("--greedy", type=int, default=8)
    ap.add_argument("--sampled", type=int, default=4)
    ap.add_argument("--vllm", action="store_true", help="also vLLM eager, 8 prompts")
    ap.add_argument("--vllm-tokens", type=int, default=400)
    ap.add_argument("--traces", nargs="*", default=[])
    ap.add_argument("--out", help="keep the traces here (default: a temporary folder)")
    args = ap.parse_args()
    from qforensics.analyze.thresholds import Thresholds

    out = Path(args.out or tempfile.mkdtemp(prefix="qf-healthy-"))
    out.mkdir(parents=True, exist_ok=True)
    paths = [Path(p) for p in args.traces]
    if args.hf_tokens > 0:
        paths += run_hf(out, args.hf_tokens, args.greedy, args.sampled)
    if args.vllm:
        paths += run_vllm(out, args.vllm_tokens)
    th = Thresholds()
    cols = ["steps", "entropy_median", "collapse_steps", "collapse_scale", "repeat_tokens",
            "repeat_scale", "growth_factor", "uniform_share", "extreme_logit",
            "degenerate_steps"]
    print("trace".ljust(22) + "".join(c[:14].rjust(15) for c in cols) + "  verdict")
    worst: dict[str, float] = {}
    for p in paths:
        stats, verdict = measure(p)
        for k, v in stats.items():
            if math.isfinite(v):
                worst[k] = max(worst.get(k, -math.inf), v)
        name = p.name if p.parent == out else os.path.relpath(p, out) if str(p).startswith(
            str(out)) else p.name
        print(name[:21].ljust(22) + "".join(f"{stats.get(c, math.nan):15.4g}" for c in cols)
              + "  " + verdict[:60])
    print("\nlargest over the healthy runs, against the threshold a failure must reach:")
    for k, (name, op) in LIMITS.items():
        lim = getattr(th, name)
        print(f"  {k:17s} {worst.get(k, math.nan):10.4g}   rule: {op} {name} = {lim:g}")
    for k in ("collapse_steps", "repeat_tokens"):
        print(f"  {k:17s} {worst.get(k, math.nan):10.4g}   (the old rule fired from "
              f"{th.logits_growth_steps if k == 'collapse_steps' else th.repeat_tokens:g})")


if __name__ == "__main__":
    main()
