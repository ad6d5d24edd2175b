"""The checkpoints what-if writes for vLLM to serve, and the AWQ W4A16 scheme they carry.

- `base_state`: the unquantized model as vLLM loads it (bfloat16, a tied lm_head left to the
  embedding), what every checkpoint starts from;
- `write_checkpoint`: an AutoAWQ GEMM folder for ``awq:w4a16[-g<N>]`` (the writer's quantizer,
  `qforensics.demo.vllm_checkpoints.awq_quantize`), a compressed-tensors one written by the
  library for ``ct:`` (`qforensics.whatif.ct_checkpoint`);
- `applied_awq`: the HF model carrying the AWQ checkpoint's dequantized weights.

Served by `qforensics.whatif.through_vllm`, counted by `qforensics.whatif.memory`.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from qforensics.errors import UsageError

__all__ = ["AWQ_SPEC", "applied_awq", "awq_group", "base_state", "check_awq_fits",
           "checkpoint_dirname", "quantized_linears", "write_checkpoint"]

AWQ_SPEC = re.compile(r"^awq:w4a16(?:-g(\d+))?$", re.IGNORECASE)
DEFAULT_GROUP = 128
_SKIP = ("lm_head",)
DIRNAME_MAX = 96  # a folder name's length stays far below the filesystems' 255 bytes


def awq_group(spec: str) -> int | None:
    """The group size of an ``awq:w4a16[-gN]`` spec, None when ``spec`` is not one."""
    m = AWQ_SPEC.match(spec.strip())
    if m is None:
        return None
    g = int(m.group(1) or DEFAULT_GROUP)
    if g < 8 or g % 2:
        raise UsageError(f"{spec}: the AWQ group size must be an even number >= 8")
    return g


def quantized_linears(model: Any) -> list[tuple[str, Any]]:
    """(name, module) of every nn.Linear a checkpoint quantizes (all but lm_head)."""
    from torch import nn

    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] not in _SKIP]


def check_awq_fits(model: Any, group: int) -> None:
    """UsageError naming the first Linear AWQ's layout cannot hold (K % G, N % 8)."""
    lin = quantized_linears(model)
    if not lin:
        raise UsageError("awq:w4a16: the model has no Linear layers to quantize")
    for name, m in lin:
        n, k = m.weight.shape
        if k % group or n % 8:
            raise UsageError(f"awq:w4a16-g{group}: {name} has in_features={k}, out_features="
                             f"{n}; AWQ needs in_features % {group} == 0 and out_features % 8 "
                             "== 0 (try another group, e.g. awq:w4a16-g64)")


@contextlib.contextmanager
def applied_awq(model: Any, group: int) -> Iterator[None]:
    """Every Linear but lm_head carries the AWQ checkpoint's dequantized weight (restored on
    exit)."""
    import torch

    from qforensics.demo.vllm_checkpoints import awq_dequantize, awq_quantize

    check_awq_fits(model, group)
    saved = []
    try:
        with torch.no_grad():
            for _name, m in quantized_linears(model):
                w = m.weight
                saved.append((w, w.detach().clone()))
                d = awq_dequantize(*awq_quantize(w.detach().float(), group), group=group)
                w.copy_(d.to(w.dtype))
        yield
    finally:
        with torch.no_grad():
            for w, orig in saved:
                w.copy_(orig)


# -- checkpoints ---------------------------------------------------------------------------------
def base_state(model: Any) -> tuple[dict, dict]:
    """(bfloat16 state dict, config dict) of an HF causal LM as vLLM loads it: a tied lm_head
    is left to the embedding, GGUF / quantization configs are dropped."""
    import torch

    cfg = model.config.to_dict()
    for k in ("quantization_config", "dtype", "_name_or_path"):
        cfg.pop(k, None)
    cfg["torch_dtype"] = "bfloat16"
    if not cfg.get("architectures"):  # a model built from a config: vLLM picks the class by it
        cfg["architectures"] = [type(model).__name__]
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    in_emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = out_emb is not None and in_emb is not None and \
        out_emb.weight.data_ptr() == in_emb.weight.data_ptr()
    if tied:
        cfg["tie_word_embeddings"] = True
        for k in [k for k in sd if k.endswith("lm_head.weight")]:
            del sd[k]
    return sd, cfg


def _write_awq(model: Any, tokenizer: Any, group: int, base: tuple[dict, dict], dst: Path
               ) -> Path:
    """An AWQ W4A16 folder (AutoAWQ's GEMM layout, ``group`` input rows per scale)."""
    from qforensics.demo.vllm_checkpoints import awq_quantize
    from qforensics.demo.vllm_model import save_model_folder as _save_folder

    sd, cfg = base
    q = dict(sd)
    for name, _ in quantized_linears(model):
        w = q.pop(f"{name}.weight")
        q[f"{name}.qweight"], q[f"{name}.qzeros"], q[f"{name}.scales"] = awq_quantize(w, group)
    c = dict(cfg)
    c["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group,
                                "zero_point": True, "version": "gemm",
                                "modules_to_not_convert": None}
    return _save_folder(dst, q, c, tokenizer)


def checkpoint_dirname(label: str) -> str:
    """The folder name of ``label``'s checkpoint: the label with every run of other characters
    than ``[A-Za-z0-9_.-]`` as ``-``; a longer one than `DIRNAME_MAX` (a mixed recipe with many
    ``keep=``: 1,500 characters) is cut and ends in a hash of the whole label, so that two
    labels do not share a folder."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", label)
    if len(name) <= DIRNAME_MAX:
        return name
    digest = hashlib.sha256(label.encode()).hexdigest()[:16]
    return f"{name[:DIRNAME_MAX - len(digest) - 1]}-{digest}"


def write_checkpoint(model: Any, tokenizer: Any, scheme: Any, base: tuple[dict, dict],
                     work: Path) -> tuple[Path, dict[str, Any]]:
    """(HF folder vLLM serves for ``scheme``, what the writer says about it): an AWQ folder
    for ``awq:``, a compressed-tensors one written by the library for ``ct:``
    (`qforensics.whatif.ct_checkpoint`)."""
    dst = work / checkpoint_dirname(scheme.label)
    if scheme.library == "awq":
        return _write_awq(model, tokenizer, scheme.awq_group, base, dst), {}
    if scheme.library == "compressed-tensors":
        from qforensics.whatif.ct_checkpoint import write_ct_checkpoint

        folder, n = write_ct_checkpoint(model, tokenizer, scheme.preset, base, dst)
        return folder, {"hf_quantized_linears": n}
    raise UsageError(f"{scheme.label}: vLLM serves published checkpoint formats (awq:, ct:)")
