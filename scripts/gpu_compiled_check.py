"""Compiled mode on a GPU, for a task that is lent one (docs/architecture.md, "Compiled mode"):

    python scripts/gpu_compiled_check.py [--tokens 32] [--mode reduce-overhead]

The real SmolLM2 (HF, bfloat16) on CUDA, compiled with torch.compile (`reduce-overhead`: CUDA
graphs), generates greedily token by token with a static shape (one new token a step, the
whole sequence re-fed: no KV cache, so every step replays the same graph): plain, then under
`qforensics.capture` in compiled mode. Prints whether the tokens are identical, the
per-step wall time of each and their ratio, the records per step, and whether torch skipped
CUDA graphs (it logs why, e.g. mutated inputs). Exit 0 when the tokens are identical and every
layer was recorded at every step, else 1. Never run without a GPU (exit 2).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--mode", default="reduce-overhead")
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing measured", file=sys.stderr)
        return 2
    import qforensics
    from qforensics.demo.model import load_model

    model, tok = load_model("bfloat16")
    model = model.cuda().eval()
    ids0 = tok("The capital of France is", return_tensors="pt").input_ids.cuda()
    width = ids0.shape[1] + a.tokens

    def generate(m) -> tuple[list[int], float]:
        x = torch.full((1, width), tok.eos_token_id or 0, device="cuda")
        x[:, :ids0.shape[1]] = ids0
        n, out, times = ids0.shape[1], [], []
        with torch.no_grad():
            for _ in range(a.tokens):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                logits = m(x).logits
                nxt = int(logits[0, n - 1].argmax())
                times.append(time.perf_counter() - t0)
                x[0, n] = nxt
                out.append(nxt)
                n += 1
        return out, sorted(times)[len(times) // 2]

    plain = torch.compile(model, mode=a.mode)
    generate(plain)  # compile and warm up
    toks_p, t_p = generate(plain)
    torch._dynamo.reset()
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/gpu.h5"
        comp = torch.compile(model, mode=a.mode)
        with qforensics.capture(comp, path):
            generate(comp)
            toks_c, t_c = generate(comp)
        t = qforensics.open_trace(path)
        st = t.meta["status"]
        rec = t.records()
        n_mod = len(t.module_columns["name"])
        per_step = rec.groupby("step").module_id.nunique()
    same = toks_p == toks_c
    full = bool((per_step == n_mod).all())
    print(f"tokens identical: {same}; every layer recorded at every step: {full} "
          f"({st.get('capture_mode')}, {st.get('graph_calls')} graph calls)")
    print(f"median step: plain {t_p * 1e3:.2f} ms, captured {t_c * 1e3:.2f} ms, "
          f"ratio {t_c / t_p:.3f}")
    return 0 if same and full else 1


if __name__ == "__main__":
    sys.exit(main())
