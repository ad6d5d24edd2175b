"""Thin torch adapters: a library's quantized layer (a torch module) -> the numpy decoders.

The only module of qforensics.layouts that imports torch (the import-linter contract says so).
Each adapter answers ``can_take(module) -> reason`` ("" when it can) from the layer's tensors'
names, dtypes and shapes, and gives the layer's dense weight [N, K] (a torch tensor on the
layer's device) from ``dense_weight(module, dtype)``: the tensors are copied to the host, decoded
by the numpy decoder in float32, and copied back (one layer's memory, once).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from qforensics.formats import FP8_FORMAT_NAMES, NUMBER_FORMATS
from qforensics.layouts import awq, compressed, fp8, gptq
from qforensics.layouts.detect import Detected, detect

__all__ = ["ADAPTERS", "FP8_TORCH_DTYPES", "TORCH_DTYPES", "AwqModule", "CompressedModule",
           "Fp8Module", "GptqModule", "detect_module", "to_numpy"]

# canonical format name (qforensics.formats) -> this torch's dtype, mapped by the table's dtype
# name; a format this torch lacks is left out
TORCH_DTYPES: dict[str, torch.dtype] = {
    n: getattr(torch, f.dtype) for n, f in NUMBER_FORMATS.items()
    if f.kind == "float" and isinstance(getattr(torch, f.dtype, None), torch.dtype)}
FP8_TORCH_DTYPES: tuple[torch.dtype, ...] = tuple(
    TORCH_DTYPES[n] for n in FP8_FORMAT_NAMES if n in TORCH_DTYPES)
_FP8 = FP8_TORCH_DTYPES


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A host numpy copy: FP8 as its uint8 bit patterns, bfloat16 widened to float32."""
    t = t.detach().cpu()
    if t.dtype in _FP8:
        return t.view(torch.uint8).numpy().copy()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy().copy()


def _tensor(module: Any, name: str) -> torch.Tensor | None:
    t = getattr(module, name, None)
    return t if isinstance(t, torch.Tensor) else None


def _need(module: Any, names: tuple[str, ...]) -> str:
    missing = [n for n in names if _tensor(module, n) is None]
    return f"it has no {', '.join(missing)}" if missing else ""


def _bits(module: Any, default: int = 4) -> int:
    for attr in ("w_bit", "bits", "wbits", "num_bits"):
        v = getattr(module, attr, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return default


def _shape(t: torch.Tensor | None) -> tuple[int, ...] | None:
    return None if t is None else tuple(t.shape)


def _out(w_kn: np.ndarray, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(w_kn.T)).to(device=like.device, dtype=dtype)


class AwqModule:
    name = "awq-gemm"

    @staticmethod
    def can_take(module: Any) -> str:
        if "WQLinear" not in type(module).__name__:
            return "not a WQLinear"
        why = _need(module, ("qweight", "qzeros", "scales"))
        if why:
            return why
        if _bits(module) != 4:
            return f"{_bits(module)}-bit AWQ is not supported (4-bit only)"
        return awq.shape_problem(_shape(module.qweight), _shape(module.qzeros), _shape(module.scales)) or ""

    @staticmethod
    def dense_weight(module: Any, dtype: torch.dtype) -> torch.Tensor:
        w = awq.dequantize(to_numpy(module.qweight), to_numpy(module.qzeros), to_numpy(module.scales),
                           out=np.float32)
        return _out(w, module.qweight, dtype)


class GptqModule:
    name = "gptq"

    @staticmethod
    def can_take(module: Any) -> str:
        if _tensor(module, "qweight") is None or "WQLinear" in type(module).__name__:
            return "not a GPTQ layer"
        why = _need(module, ("qzeros", "scales"))
        if why:
            return why
        gi = _tensor(module, "g_idx")
        why = gptq.shape_problem(_shape(module.qweight), _shape(module.qzeros), _shape(module.scales),
                                 _bits(module), g_idx=None if gi is None else gi.numel())
        if why:
            return why
        k, groups = module.qweight.shape[0] * 32 // _bits(module), module.scales.shape[0]
        if gi is None and (groups == 0 or k % groups):
            return f"K={k} is not a multiple of the {groups} scale groups"
        return ""

    @staticmethod
    def dense_weight(module: Any, dtype: torch.dtype) -> torch.Tensor:
        gi = _tensor(module, "g_idx")
        v2 = gptq.is_v2(str(getattr(module, "checkpoint_format", "") or ""),
                        getattr(module, "qzero_format", None))
        w = gptq.dequantize(to_numpy(module.qweight), to_numpy(module.qzeros), to_numpy(module.scales),
                            _bits(module), None, None if gi is None else to_numpy(gi), v2=v2, out=np.float32)
        return _out(w, module.qweight, dtype)


class CompressedModule:
    name = "ct-pack-quantized"

    @staticmethod
    def bits(module: Any) -> int:
        args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
        b = getattr(args, "num_bits", None)
        if isinstance(b, int):
            return b
        k = int(module.weight_shape.reshape(-1)[1])
        return round(module.weight_packed.shape[1] * 32 / k) if k else 0

    @classmethod
    def can_take(cls, module: Any) -> str:
        if _tensor(module, "weight_packed") is None:
            return "not a compressed-tensors packed layer"
        why = _need(module, ("weight_scale", "weight_shape"))
        if why:
            return why
        shape = [int(v) for v in module.weight_shape.reshape(-1).tolist()]
        if len(shape) != 2:
            return f"weight_shape {shape} is not [N, K]"
        zp = _tensor(module, "weight_zero_point")
        return compressed.shape_problem(_shape(module.weight_packed), _shape(module.weight_scale),
                                        (shape[0], shape[1]), cls.bits(module), _shape(zp)) or ""

    @classmethod
    def dense_weight(cls, module: Any, dtype: torch.dtype) -> torch.Tensor:
        zp = _tensor(module, "weight_zero_point")
        shape = tuple(int(v) for v in module.weight_shape.reshape(-1).tolist())
        w = compressed.dequantize(to_numpy(module.weight_packed), to_numpy(module.weight_scale), shape,
                                  cls.bits(module), None if zp is None else to_numpy(zp), out=np.float32)
        return _out(w, module.weight_packed, dtype)


class Fp8Module:
    name = "fp8"

    @staticmethod
    def scale(module: Any) -> torch.Tensor | None:
        sc = _tensor(module, "weight_scale")
        return sc if sc is not None else _tensor(module, "weight_scale_inv")

    @staticmethod
    def block(module: Any) -> tuple[int, int] | None:
        for attr in ("weight_block_size", "block_size"):
            v = getattr(module, attr, None)
            if isinstance(v, (list, tuple)) and len(v) == 2:
                return int(v[0]), int(v[1])
        return None

    @classmethod
    def can_take(cls, module: Any) -> str:
        w = _tensor(module, "weight")
        if w is None or w.dtype not in _FP8:
            return "not an FP8 weight"
        sc = cls.scale(module)
        if sc is None:
            return "its float8 weight has no weight_scale (or weight_scale_inv)"
        if w.dim() != 2:
            return f"its weight has {w.dim()} dimensions, not 2"
        if fp8.scale_kind(tuple(sc.shape), w.shape[0], w.shape[1], cls.block(module)) is None:
            return f"weight_scale {tuple(sc.shape)} is neither per tensor, per channel nor per block"
        return ""

    @classmethod
    def dense_weight(cls, module: Any, dtype: torch.dtype) -> torch.Tensor:
        w = module.weight
        kind = str(w.dtype).replace("torch.", "")
        dq = fp8.dequantize_fp8(to_numpy(w), to_numpy(cls.scale(module)), kind, cls.block(module),
                                out=np.float32)
        return _out(dq, w, dtype)


ADAPTERS = {a.name: a for a in (AwqModule, GptqModule, CompressedModule, Fp8Module)}


# the kernel that multiplies by each layout an engine chose at load (None: the engine's own path)
ENGINE_KERNELS = {"vllm-cpu-w4a16": "vllm-cpu-wna16", "vllm-cpu-w4a8": None}


def engine_layout(module: Any) -> str | None:
    """The layout the engine chose for this live layer at load (vLLM's CPU W4A16/W4A8 kernel
    decides per layer, `use_w4a8`); None when no engine said."""
    use_w4a8 = getattr(module, "use_w4a8", None)
    return None if use_w4a8 is None else ("vllm-cpu-w4a8" if use_w4a8 else "vllm-cpu-w4a16")


def detect_module(module: Any) -> Detected:
    """The layout of a live layer (the detector on its tensors, class and engine facts)."""
    tensors = {n: t for n, t in list(module.named_parameters(recurse=False)) +
               list(module.named_buffers(recurse=False))}
    for name in ("qweight", "scales", "weight_packed", "weight_scale"):  # plain attributes too
        t = _tensor(module, name)
        if t is not None:
            tensors.setdefault(name, t)
    return detect(tensors, type(module).__name__, engine_layout=engine_layout(module),
                  bits=_bits(module))
