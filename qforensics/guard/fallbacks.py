"""Per-layer fallbacks: the dense path a guarded module runs when it trips.

Each fallback is a small strategy class in the shape of vLLM's kernel classes: before anything
runs, ``can_take(module)`` answers ``(ok, reason)`` (the reason in words a user can act on);
the first class that takes a module is bound to it at set-up, and it does its work - reading a
float weight, or dequantizing a packed one - only when the module trips. A quantized layer is
dequantized once, on its first trip, to the activation dtype (one layer's memory), and the
dense weight is reused from then on.

`choose_fallback` walks `FALLBACKS` in order; `select_guarded` says which modules a policy
guards. The base class and the dense matmul are `qforensics.guard.fallback_base`'s;
quantized layouts (AWQ, GPTQ, compressed-tensors, FP8, bitsandbytes) are in
`qforensics.guard.layouts`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qforensics.guard.fallback_base import Fallback, dense_linear
from qforensics.guard.layouts import QUANTIZED_FALLBACKS
from qforensics.guard.policy import GuardError, GuardPolicy
from qforensics.layerkinds import LINEAR_CLASS_NAME, QUANT_ATTRS, is_linear_like
from qforensics.layouts.torch_adapters import FP8_TORCH_DTYPES

__all__ = [
    "FALLBACKS",
    "DenseLinear",
    "Fallback",
    "GivenWeight",
    "TransposedConv1D",
    "choose_fallback",
    "dense_linear",
    "is_quantized",
    "select_guarded",
]

class GivenWeight(Fallback):
    """``policy.fallback_weights[name]``: a higher-precision weight the caller kept aside."""

    layout = "given weight"

    def __init__(self, module: nn.Module, policy: GuardPolicy, weight: torch.Tensor) -> None:
        super().__init__(module, policy)
        self._dense = weight.detach()

    @classmethod
    def can_take(cls, module: nn.Module) -> tuple[bool, str]:
        return True, ""

    @staticmethod
    def check(name: str, weight: Any) -> tuple[bool, str]:
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() \
                or weight.dim() != 2:
            return False, (f"policy.fallback_weights[{name!r}] must be a 2-D float tensor "
                           "[out, in]")
        return True, ""


class DenseLinear(Fallback):
    """A module with a float 2-D weight [out, in] (nn.Linear, `FakeQuantLinear`): recompute
    with that weight on the module's unquantized input, in float32 when it runs in half."""

    layout = "dense"

    def __init__(self, module: nn.Module, policy: GuardPolicy) -> None:
        super().__init__(module, policy)
        w = module.weight.detach()
        self._dense = w.clone() if policy.copy_weights else w

    @classmethod
    def can_take(cls, module: nn.Module) -> tuple[bool, str]:
        w = getattr(module, "weight", None)
        if not isinstance(w, torch.Tensor):
            return False, "no weight tensor"
        if not w.is_floating_point() or w.dtype in FP8_TORCH_DTYPES:
            return False, f"its weight is {str(w.dtype).replace('torch.', '')}, not a float dtype"
        if w.dim() != 2:
            return False, f"its weight has {w.dim()} dimensions, not 2"
        if type(w) is not torch.Tensor and type(w) is not nn.Parameter:
            return False, f"its weight is a {type(w).__name__}, not a plain tensor"
        return True, ""


class TransposedConv1D(DenseLinear):
    """transformers' GPT-2 ``Conv1D``: a float weight stored [in, out]."""

    layout = "dense (Conv1D)"

    def __init__(self, module: nn.Module, policy: GuardPolicy) -> None:
        super().__init__(module, policy)
        self._dense = self._dense.t()

    @classmethod
    def can_take(cls, module: nn.Module) -> tuple[bool, str]:
        if type(module).__name__ != "Conv1D":
            return False, "not a Conv1D"
        return DenseLinear.can_take(module)


# Tried in this order; quantized layouts come first (a bitsandbytes Params4bit is also a uint8
# "weight"), then Conv1D, then plain float weights.
FALLBACKS: list[type[Fallback]] = [*QUANTIZED_FALLBACKS, TransposedConv1D, DenseLinear]


def choose_fallback(name: str, module: nn.Module, policy: GuardPolicy
                    ) -> tuple[Fallback | None, str]:
    """The fallback bound to ``module``, or None and why there is none (every refusal)."""
    given = (policy.fallback_weights or {}).get(name)
    if given is not None:
        ok, why = GivenWeight.check(name, given)
        if not ok:
            raise GuardError(f"guard: {why}")
        return GivenWeight(module, policy, given), ""
    reasons = []
    for cls in FALLBACKS:
        ok, why = cls.can_take(module)
        if ok:
            return cls(module, policy), ""
        if why and not why.startswith("not a"):
            reasons.append(f"{cls.layout}: {why}")
    detail = "; ".join(reasons) or "no fallback knows its layout"
    return None, (f"no fallback for {type(module).__name__} ({detail}); pass "
                  "policy.fallback_weights={name: dense weight} to give it one")


def is_quantized(module: nn.Module) -> bool:
    """A module whose weight is stored quantized, or that quantizes inside its forward."""
    if getattr(module, "qforensics_quant", None) is not None:  # FakeQuantLinear
        return True
    if any(isinstance(getattr(module, a, None), torch.Tensor) for a in QUANT_ATTRS):
        return True
    w = getattr(module, "weight", None)
    if isinstance(w, torch.Tensor) and not w.is_floating_point():
        return True
    if isinstance(w, torch.Tensor) and w.dtype in FP8_TORCH_DTYPES:
        return True
    name = type(module).__name__
    return bool(LINEAR_CLASS_NAME.search(name)) and name not in ("Linear", "Conv1D")


def select_guarded(model: nn.Module, spec: Any) -> list[tuple[str, nn.Module]]:
    """The (name, module) pairs ``policy.modules`` chooses, in model order."""
    named = [(n, m) for n, m in model.named_modules() if m is not model]
    if callable(spec) and not isinstance(spec, str):
        return [(n, m) for n, m in named if spec(n, m)]
    if isinstance(spec, str) and spec in ("auto", "quantized", "linear"):
        linear = [(n, m) for n, m in named if is_linear_like(m)]
        if spec == "linear":
            return linear
        quant = [(n, m) for n, m in linear if is_quantized(m)]
        return quant if quant or spec == "quantized" else linear
    names = {spec} if isinstance(spec, str) else set(spec)
    found = [(n, m) for n, m in named if n in names]
    missing = names - {n for n, _ in found}
    if missing:
        raise GuardError(f"guard: no module named {sorted(missing)[0]!r} in "
                         f"{type(model).__name__} ({len(missing)} of {len(names)} names missing)")
    return found

