"""The base of the guard's per-layer fallbacks (`Fallback`: what a guarded module runs when it
trips) and the dense matmul every fallback ends in. The fallbacks themselves and the order they
are tried in: qforensics.guard.fallbacks and qforensics.guard.layouts."""

from __future__ import annotations

import threading
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from qforensics.guard.policy import GuardPolicy

__all__ = ["Fallback", "dense_linear"]

_LOW = (torch.float16, torch.bfloat16)


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """``x @ weight.T + bias`` in float32 when any side is half precision, clamped to the
    output dtype's range (a finite fallback never overflows into Inf on the way out)."""
    if x.dtype in _LOW or weight.dtype in _LOW or out_dtype in _LOW:
        y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    else:
        y = F.linear(x.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype))
    if out_dtype in _LOW:
        lim = torch.finfo(out_dtype).max
        y = y.clamp(-lim, lim)
    return y.to(out_dtype)


def _bias_of(module: nn.Module) -> torch.Tensor | None:
    b = getattr(module, "bias", None)
    return b.detach() if isinstance(b, torch.Tensor) and b.is_floating_point() else None


class Fallback:
    """A guarded module's dense path. Subclasses set ``layout`` and implement ``can_take`` and
    ``dense_weight`` (the module's weight as a float tensor [out, in])."""

    layout: ClassVar[str] = "?"

    def __init__(self, module: nn.Module, policy: GuardPolicy) -> None:
        self.module = module
        self.policy = policy
        self._dense: torch.Tensor | None = None
        self._lock = threading.Lock()

    @classmethod
    def can_take(cls, module: nn.Module) -> tuple[bool, str]:
        raise NotImplementedError

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def weight_for(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense weight, built on the first call (once; thread-safe) and kept."""
        w = self._dense
        if w is None:
            with self._lock:
                if self._dense is None:
                    self._dense = self.dense_weight(dtype)
                w = self._dense
        return w

    @property
    def materialized(self) -> bool:
        """Whether the dense weight has been built (a quantized layer: it has tripped)."""
        return self._dense is not None

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        """The activation as the layer's own kernel would see it (identity by default)."""
        return x

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        act = x.dtype if x.is_floating_point() else out_dtype
        return dense_linear(self.weight_for(act), _bias_of(self.module), self.prepare_input(x),
                            out_dtype)

    def describe(self) -> str:
        return f"{self.layout} fallback for {type(self.module).__name__}"
