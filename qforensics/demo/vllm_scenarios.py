"""Failing vLLM scenarios of the real SmolLM2 (`qforensics demo --engine vllm`): each is a
quantized checkpoint with one documented corruption, served by vLLM with its real kernels under
`qforensics record`, then analyzed. The corruption is said in the checkpoint's config.json
(`qforensics_corruption`) and in the scenario's expectation, never read back by the analysis."""

from __future__ import annotations

from typing import Callable

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
