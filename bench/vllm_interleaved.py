"""Capture overhead inside vLLM, plain and captured calls interleaved in ONE engine.

    .venv-vllm/bin/python bench/vllm_interleaved.py               # 8 pairs, 8 prompts x 64 tokens
    .venv-vllm/bin/python bench/vllm_interleaved.py --pairs 12 --record-args "--channel-steps none"

bench/vllm_overhead.py starts a fresh engine per variant and compares the fastest call of each.
On a shared machine whose speed drifts by 10-20% over minutes (this project's 2-core VM), that
ratio moves by as much as the overhead it measures. Here one program runs under
`qforensics record` with vLLM's engine in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=0, a
fixed schedule) and times `generate` calls alternately with capture's hooks detached and attached
(order ABBA, so that a drift weighs on both sides alike). Detaching empties the hook tables of
the model's modules for the plain call, and puts them back after it: that is a measuring device of this script, not
something qforensics offers. Steps run while detached are not recorded.

Prints the median of the per-pair ratios (captured / plain, the figure to quote), the ratio of
the fastest calls, and whether the captured calls generated the same tokens as the plain ones.

`--profile` also wraps capture's main functions with timers and prints where a captured step's
time went, in ms per step (the timers themselves slow the captured calls: read its ratio as an
upper bound, and a small function's figure as inflated by about a microsecond per call).
"""

from __future__ import annotations

import argparse
import collections
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from step_timers import profile as _profile  # noqa: E402
from step_timers import report  # noqa: E402
from vllm_overhead import PROMPTS  # noqa: E402

_HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs")


def _child(a: argparse.Namespace) -> int:
    spent, calls = _profile() if a.profile else ({}, {})
    from vllm import LLM, SamplingParams

    from qforensics.engines import vllm as adapter

    llm = LLM(model=a.model, dtype="bfloat16", enforce_eager=True, max_model_len=512, seed=0)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    key = id(runner)
    cap = adapter._captures.get(key)
    if cap is None:
        sys.exit("no qforensics capture is attached to the vLLM runner (run under record)")
    mods = list(runner.model.modules())
    saved: dict[int, list] = {}

    def detach() -> None:
        for m in mods:  # the hook tables (and a forward set on the instance, if any)
            saved[id(m)] = [getattr(m, n) for n in _HOOK_TABLES] + [m.__dict__.pop("forward",
                                                                                  None)]
            for n in _HOOK_TABLES:
                setattr(m, n, collections.OrderedDict())
        adapter._captures.pop(key)

    def attach() -> None:
        for m in mods:
            *tables, fwd = saved[id(m)]
            for n, v in zip(_HOOK_TABLES, tables):
                setattr(m, n, v)
            if fwd is not None:
                m.__dict__["forward"] = fwd
        adapter._captures[key] = cap

    prompts = (PROMPTS * (a.prompts // len(PROMPTS) + 1))[: a.prompts]
    params = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)

    def run() -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    run()  # warm: first-call allocations, the fused reduction's library
    res: dict[str, list] = {"plain": [], "captured": [], "plain_tokens": [], "cap_tokens": []}
    for i in range(a.pairs):
        for mode in (("plain", "captured") if i % 2 == 0 else ("captured", "plain")):
            if mode == "plain":
                detach()
                try:
                    t, toks = run()
                finally:
                    attach()
                res["plain_tokens"].append(toks)
            else:
                t, toks = run()
                res["cap_tokens"].append(toks)
            res[mode].append(t)
        print(f"pair {i + 1}/{a.pairs}: plain {res['plain'][-1]:.3f} s, captured "
              f"{res['captured'][-1]:.3f} s", file=sys.stderr, flush=True)
    if a.profile:  # over the captured calls only (the plain ones run without hooks)
        res["profile"] = {"steps": calls.get("VllmAdapter.step_began", 0),
                          "ns": dict(spent), "calls": dict(calls)}
    Path(a.child).write_text(json.dumps(res))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=8, help="plain/captured pairs of calls")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--record-args", default="",
                    help='capture options for record, e.g. "--channel-steps none"')
    ap.add_argument("--profile", action="store_true",
                    help="time capture's main functions, print ms per captured step")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return _child(a)
    if a.pairs < 1:
        ap.error("--pairs must be at least 1")
    from qforensics.demo.vllm_model import vllm_model_dir
    from qforensics.demo.vllm_scenarios import serve_env

    env = serve_env()
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "res.json"
        cmd = [sys.executable, "-m", "qforensics.cli", "record", "-o", str(Path(tmp) / "t.h5"),
               *shlex.split(a.record_args), "--", sys.executable, str(Path(__file__).resolve()),
               "--child", str(out), "--model", str(vllm_model_dir()), "--pairs", str(a.pairs),
               "--prompts", str(a.prompts), "--tokens", str(a.tokens),
               *(["--profile"] if a.profile else [])]
        print(f"one engine, {a.pairs} pairs of generate calls ({a.prompts} prompts x "
              f"{a.tokens} tokens), plain and captured alternately ...", file=sys.stderr)
        proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, check=False)
        if proc.returncode != 0 or not out.exists():
            sys.exit(f"the vLLM run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        res = json.loads(out.read_text())
        import qforensics

        with qforensics.open_trace(Path(tmp) / "t.h5") as t:
            status = t.meta.get("status", {})
    p, c = res["plain"], res["captured"]
    pairs = [x / y for x, y in zip(c, p)]
    same = sum(x == y for x, y in zip(res["plain_tokens"], res["cap_tokens"]))
    print(f"vLLM engine in this process, {len(p)} pairs of calls "
          f"({a.record_args or 'record defaults'}):")
    print(f"  plain     median {statistics.median(p):.3f} s, fastest {min(p):.3f} s")
    print(f"  captured  median {statistics.median(c):.3f} s, fastest {min(c):.3f} s")
    print(f"  ratio captured / plain: median of pairs {statistics.median(pairs):.3f} "
          f"(pairs {min(pairs):.3f}-{max(pairs):.3f}); fastest to fastest {min(c) / min(p):.3f} "
          f"(target <= 1.10)")
    print(f"  calls whose tokens equal the plain call's of the same pair: {same} of {len(p)}")
    print("  how the hooks ran (trace status): " + ", ".join(
        f"{k} {status.get(k)}" for k in ("hook_path", "capture_mode", "graph_eager_calls",
                                         "reduction")))
    prof = res.get("profile")
    if prof and prof["steps"]:
        n = prof["steps"]
        per_call = n / (len(p) + 1)  # the warm-up call ran captured too
        print(f"where a captured step's time went ({n} steps, a plain step "
              f"{statistics.median(p) / per_call * 1e3:.1f} ms):")
        report(prof["ns"], prof["calls"], n)
    return 0 if same == len(p) else 1


if __name__ == "__main__":
    raise SystemExit(main())
