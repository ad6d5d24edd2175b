"""Static-scale FP8 activations, as serving stacks run them: each Linear quantizes its input with
a fixed per-tensor `input_scale` found once by calibration, then saturates at the format's
largest value (vLLM's and compressed-tensors' FP8 W8A8 layers keep the same `input_scale`
attribute, which capture reads to know the range the layer can represent).

- `calibrate_input_scales(model, run, skip_tokens=0)`: absmax / 448 of each Linear's input over
  one calibration run. ``skip_tokens=1`` leaves out the first position of every sequence, which
  is what a calibration that never saw the attention-sink token computes: scales too low for the
  massive activations that token carries.
- `emulate_static_fp8(model, scales)`: swap each Linear named in `scales` for a
  `StaticFP8Linear` (shares the parameters; swapped back on exit).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Self

import torch
from torch import nn

from qforensics.formats import FP8_FORMAT_NAMES, canonical_format, number_format
from qforensics.quant.errors import QuantApplyError
from qforensics.quant.fp8 import fake_quant_fp8
from qforensics.quant.model import find_linears

__all__ = ["StaticFP8Linear", "StaticFP8Linears", "calibrate_input_scales", "emulate_static_fp8"]


class StaticFP8Linear(nn.Linear):
    """nn.Linear whose input is quantized to FP8 with the fixed scale `input_scale` (a float32
    scalar buffer, as in vLLM / compressed-tensors), saturating at the format's maximum."""

    def __init__(self, base: nn.Linear, input_scale: float, fmt: str = "e4m3") -> None:
        nn.Module.__init__(self)
        if not (input_scale > 0 and input_scale < float("inf")):
            raise QuantApplyError(f"input_scale must be a positive finite number, got "
                                  f"{input_scale!r}")
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.weight = base.weight
        self.bias = base.bias
        canon = canonical_format(fmt)  # the trace records the format's canonical name
        if canon not in FP8_FORMAT_NAMES:
            raise QuantApplyError(f"unknown FP8 format {fmt!r}; valid: e4m3, e5m2")
        self.fmt = fmt
        self._scale = float(input_scale)  # no device read in forward
        self.register_buffer("input_scale", torch.tensor(self._scale, dtype=torch.float32))
        self.qforensics_quant = {"format": f"{canon}-static", "target": "activations",
                                 "bits": 8, "act_format": canon}

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        q = fake_quant_fp8(input, self.fmt, saturate=True, scale=self._scale)  # type: ignore
        return nn.functional.linear(q, self.weight, self.bias)


def _record(name: str, skip: int, store: dict[str, torch.Tensor], module: nn.Module,
            args: tuple[Any, ...]) -> None:
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 2:
        return
    if x.dim() >= 3:
        x = x[:, skip:]
    elif skip:
        x = x[skip:]
    if x.numel() == 0:
        return
    amax = x.detach().abs().amax().float()
    prev = store.get(name)
    store[name] = amax if prev is None else torch.maximum(prev, amax)


def calibrate_input_scales(model: nn.Module, run: Callable[[], Any], *, fmt: str = "e4m3",
                           skip_tokens: int = 0, exclude: Sequence[str] = ("lm_head",)
                           ) -> dict[str, float]:
    """{Linear name: absmax of its input / the format's max} over one call of `run` (hooks
    removed afterwards). `skip_tokens` leaves out the first positions of each sequence."""
    qmax = number_format(fmt).max
    store: dict[str, torch.Tensor] = {}
    handles = [mod.register_forward_pre_hook(functools.partial(_record, name, skip_tokens, store))
               for name, mod in find_linears(model, exclude)]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return {n: max(float(a) / qmax, 1e-12) for n, a in store.items()}


class StaticFP8Linears:
    """Context manager from `emulate_static_fp8`."""

    def __init__(self, model: nn.Module, scales: Mapping[str, float], fmt: str) -> None:
        self.model, self.scales, self.fmt = model, dict(scales), fmt
        self._swapped: list[tuple[nn.Module, str, nn.Module]] = []

    def __enter__(self) -> Self:
        named = dict(self.model.named_modules())
        missing = [n for n in self.scales if not isinstance(named.get(n), nn.Linear)]
        if missing:
            raise QuantApplyError(f"no nn.Linear named {', '.join(missing[:5])} in "
                                  f"{type(self.model).__name__}")
        try:
            for name, scale in self.scales.items():
                parent_name, _, attr = name.rpartition(".")
                parent = named[parent_name] if parent_name else self.model
                setattr(parent, attr, StaticFP8Linear(named[name], scale, self.fmt))  # type: ignore
                self._swapped.append((parent, attr, named[name]))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        while self._swapped:
            parent, attr, mod = self._swapped.pop()
            setattr(parent, attr, mod)


def emulate_static_fp8(model: nn.Module, scales: Mapping[str, float], *, fmt: str = "e4m3"
                       ) -> StaticFP8Linears:
    """Run each Linear named in `scales` with static-scale FP8 inputs (restored on exit)."""
    return StaticFP8Linears(model, scales, fmt)
