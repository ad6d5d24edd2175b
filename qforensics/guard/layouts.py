"""Fallbacks for quantized weight layouts: each dequantizes its layer's packed weight ONCE, on
the layer's first trip, to the activation dtype (one layer's memory); the guard then runs the
layer dense.

- `AwqGemm` (AutoAWQ ``WQLinear_GEMM``), `GptqPacked` (GPTQ ``QuantLinear``, v1/v2 zeros,
  act-order), `CompressedPacked` (compressed-tensors ``pack-quantized``), `Fp8Weight` (float8
  weight with per-tensor, per-channel or block scales): the layouts are decoded by
  qforensics.layouts (its torch adapters), the one place that knows them. `Fp8Weight` also
  quantizes the activation as the layer's kernel does, but saturating: with a static
  ``input_scale`` to ±448·input_scale, without one (dynamic) per token; so the fallback matches
  the layer wherever the layer was finite.
- `BitsAndBytes4bit` / `BitsAndBytes8bit`: bitsandbytes ``Linear4bit`` (NF4 / FP4, dequantized
  by the library's own ``dequantize_4bit``) and ``Linear8bitLt`` (int8 ``CB`` with per-row
  ``SCB``: W = CB * SCB / 127).
- `QuantoWeight`: optimum-quanto ``QLinear`` (qint2/4/8, qfloat8 weights), dequantized by the
  library's own ``QTensor.dequantize``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qforensics.guard.fallback_base import Fallback
from qforensics.layouts.torch_adapters import (
    FP8_TORCH_DTYPES,
    AwqModule,
    CompressedModule,
    Fp8Module,
    GptqModule,
)

__all__ = [
    "QUANTIZED_FALLBACKS",
    "AwqGemm",
    "BitsAndBytes4bit",
    "BitsAndBytes8bit",
    "CompressedPacked",
    "Fp8Weight",
    "GptqPacked",
    "QuantoWeight",
]

_FP8 = FP8_TORCH_DTYPES  # by the names of qforensics.formats


def _tensor(module: nn.Module, name: str) -> torch.Tensor | None:
    t = getattr(module, name, None)
    return t if isinstance(t, torch.Tensor) else None


class _Decoded(Fallback):
    """A layout qforensics.layouts decodes: its torch adapter says whether it takes the layer
    and gives the dense weight."""

    adapter: Any = None

    @classmethod
    def can_take(cls, module: nn.Module) -> tuple[bool, str]:
        why = cls.adapter.can_take(module)
        return (not why), why

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return self.adapter.dense_weight(self.module, dtype)


class AwqGemm(_Decoded):
    layout = "AWQ GEMM"
    adapter = AwqModule


class GptqPacked(_Decoded):
    layout = "GPTQ"
    adapter = GptqModule


class CompressedPacked(_Decoded):
    layout = "compressed-tensors pack-quantized"
    adapter = CompressedModule


class Fp8Weight(_Decoded):
    layout = "FP8"
    adapter = Fp8Module

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        fmax = torch.finfo(self.module.weight.dtype).max
        s_in = _tensor(self.module, "input_scale")
        xf = x.float()
        if s_in is not None and s_in.numel() == 1:  # static: the layer's scale, saturating
            s = s_in.float().reshape(())
        else:  # dynamic per-token scale (what a dynamic FP8 kernel computes)
            s = (xf.abs().amax(-1, keepdim=True) / fmax).clamp_min(1e-12)
            s = torch.where(torch.isfinite(s), s, torch.ones_like(s))
        q = (xf / s).clamp(-fmax, fmax).to(self.module.weight.dtype)
        return (q.float() * s).to(x.dtype if x.dtype not in _FP8 else torch.float32)


def _is_bnb(module: nn.Module, name: str) -> bool:
    """``module`` is (a subclass of) bitsandbytes' ``name`` (matched without importing it)."""
    return any(c.__module__.startswith("bitsandbytes") and c.__name__ == name
               for c in type(module).__mro__)


class BitsAndBytes4bit(Fallback):
    layout = "bitsandbytes 4-bit"

    @classmethod
    def can_take(cls, module: nn.Module) -> tuple[bool, str]:
        if not _is_bnb(module, "Linear4bit"):
            return False, "not a bitsandbytes Linear4bit"
        if getattr(getattr(module, "weight", None), "quant_state", None) is None:
            return False, ("its weight is not quantized yet (bitsandbytes quantizes when the "
                           "layer is moved to its device)")
        return True, ""

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        import bitsandbytes.functional as bf

        w = self.module.weight
        return bf.dequantize_4bit(w.data, w.quant_state).to(dtype)


class BitsAndBytes8bit(Fallback):
    layout = "bitsandbytes int8"

    @classmethod
    def can_take(cls, module: nn.Module) -> tuple[bool, str]:
        if not _is_bnb(module, "Linear8bitLt"):
            return False, "not a bitsandbytes Linear8bitLt"
        cb, scb = cls._parts(module)
        if cb is None or scb is None:
            return False, "its int8 weight has no CB / SCB (not quantized yet)"
        return True, ""

    @staticmethod
    def _parts(module: nn.Module) -> tuple[Any, Any]:
        w = getattr(module, "weight", None)
        state = getattr(module, "state", None)
        cb = getattr(w, "CB", None)
        if cb is None:
            cb = getattr(state, "CB", None)
        if cb is None and isinstance(w, torch.Tensor) and w.dtype == torch.int8:
            cb = w.data
        scb = getattr(w, "SCB", None)
        if scb is None:
            scb = getattr(state, "SCB", None)
        return cb, scb

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        cb, scb = self._parts(self.module)
        return (cb.float() * (scb.float().reshape(-1, 1) / 127.0)).to(dtype)


class QuantoWeight(Fallback):
    layout = "optimum-quanto"

    @classmethod
    def can_take(cls, module: nn.Module) -> tuple[bool, str]:
        if not any(c.__module__.startswith("optimum.quanto") for c in type(module).__mro__):
            return False, "not an optimum-quanto layer"
        if not callable(getattr(cls._qweight(module), "dequantize", None)):
            return False, "its weight is not quantized (call optimum.quanto.quantize first)"
        return True, ""

    @staticmethod
    def _qweight(module: nn.Module) -> Any:
        w = getattr(module, "weight", None)
        if w is not None and type(w) not in (torch.Tensor, nn.Parameter):
            return w  # frozen: the weight is a quanto QTensor
        return getattr(module, "qweight", None)  # not frozen: quantized on access

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        with torch.no_grad():
            w = self._qweight(self.module).dequantize()
        return w.detach().to(dtype)


QUANTIZED_FALLBACKS: list[type[Fallback]] = [AwqGemm, GptqPacked, CompressedPacked, Fp8Weight,
                                             BitsAndBytes4bit, BitsAndBytes8bit, QuantoWeight]
