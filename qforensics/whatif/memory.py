"""What-if memory: the weight bytes of a scheme's checkpoint, as a ratio to the bfloat16 one.

A checkpoint's weight bytes are counted from its safetensors files' headers (each tensor's
dtype and shape; the header is all a safetensors file says about its tensors), as the engine
serves them: integer and FP8 tensors (packed weights, zero points, int8 / float8 weights) at
their stored width, floating tensors at most 2 bytes per element, because vLLM loads them in
bfloat16 (``--dtype bfloat16``; an llmcompressor checkpoint keeps its unquantized tensors in
float32, which would otherwise count double). ``stored_bytes`` is the plain sum of the tensors
as stored. The reference is the unquantized bfloat16 checkpoint of the same model
(`qforensics.whatif.checkpoints.base_state`), counted the same way.

Schemes with no checkpoint format (the project's fake-quant ``w:`` / ``act:`` specs) have no
memory figure: they are measured by the HF path only.
"""

from __future__ import annotations

import json
import math
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qforensics.errors import QForensicsError

__all__ = ["SERVED_FLOAT_BYTES", "checkpoint_memory", "memory_figures", "served_weight_bytes"]

SERVED_FLOAT_BYTES = 2  # bfloat16, the dtype vLLM serves every floating tensor in here
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
             "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_FLOATS = {"F16", "BF16", "F32", "F64"}
_MAX_HEADER = 100 << 20


def _header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise QForensicsError(f"{path}: not a safetensors file (shorter than its header)")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER:
            raise QForensicsError(f"{path}: safetensors header of {n} bytes: not a checkpoint")
        return json.loads(fh.read(n))


def served_weight_bytes(folder: str | Path) -> dict[str, int]:
    """{"weight_bytes": as served (see the module docstring), "stored_bytes": as stored,
    "tensors": how many} over every ``*.safetensors`` file in ``folder``."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise QForensicsError(f"{folder}: no safetensors files to count weights in")
    served = stored = count = 0
    for f in files:
        for name, info in _header(f).items():
            if name == "__metadata__":
                continue
            dtype = str(info["dtype"])
            if dtype not in _ITEMSIZE:
                raise QForensicsError(f"{f}: tensor {name} has dtype {dtype}, unknown here")
            numel = math.prod(int(d) for d in info["shape"])
            size = _ITEMSIZE[dtype]
            stored += numel * size
            served += numel * (min(size, SERVED_FLOAT_BYTES) if dtype in _FLOATS else size)
            count += 1
    return {"weight_bytes": served, "stored_bytes": stored, "tensors": count}


def memory_figures(scheme: dict[str, int], bf16: dict[str, int]) -> dict[str, Any]:
    """A scheme's memory entry: its weight bytes, the bfloat16 reference's, and their ratio."""
    return {"weight_bytes": scheme["weight_bytes"], "stored_bytes": scheme["stored_bytes"],
            "bf16_weight_bytes": bf16["weight_bytes"],
            "vs_bf16": scheme["weight_bytes"] / bf16["weight_bytes"]}


def checkpoint_memory(model: Any, tokenizer: Any, schemes: list[Any], *,
                      prebuilt: dict[str, Path] | None = None,
                      say: Callable[[str], None] = lambda m: None) -> dict[str, dict[str, Any]]:
    """{label: memory entry} for each scheme with a checkpoint format (``awq:``, ``ct:``, and
    ``llmc:`` ones in ``prebuilt``), each written as ``--engine vllm`` writes it, counted, and
    removed. What cannot be written gets ``{"error": why}``."""
    from qforensics.demo.vllm_model import save_model_folder as _save_folder
    from qforensics.whatif.checkpoints import base_state, write_checkpoint

    todo = [s for s in schemes if s.library in ("awq", "compressed-tensors")
            or s.label in (prebuilt or {})]
    if not todo:
        return {}
    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="qforensics-whatif-mem-") as tmp:
        work = Path(tmp)
        base = base_state(model)
        say("memory: writing the bfloat16 checkpoint and each scheme's, to count their weights")
        ref = served_weight_bytes(_save_folder(work / "ref-bf16", base[0], dict(base[1]),
                                               tokenizer))
        for sc in todo:
            try:
                folder = (Path(prebuilt[sc.label]) if sc.label in (prebuilt or {}) else
                          write_checkpoint(model, tokenizer, sc, base, work)[0])
                out[sc.label] = memory_figures(served_weight_bytes(folder), ref)
            except QForensicsError as exc:
                out[sc.label] = {"error": str(exc)}
    return out
