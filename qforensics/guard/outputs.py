"""Adapters between the guard and what a model's forward takes and returns: the guarded module's
input, the logits inside whatever the root forward returned (tensor, tuple, ModelOutput), the KV
cache among its keyword arguments, and the one batched device->host read per step."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["cache_of", "fetch", "input_of", "logits_of", "nonfinite_counts", "split_output",
           "with_logits"]

_CACHE_KWARGS = ("past_key_values", "cache", "past_key_value", "layer_past")


def input_of(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The floating-point activation a linear-like module was called with, or None."""
    x = args[0] if args else kwargs.get("input", kwargs.get("x", kwargs.get("input_")))
    return x if isinstance(x, torch.Tensor) and x.is_floating_point() else None


def split_output(output: Any) -> tuple[torch.Tensor | None, Any]:
    """(the float tensor a linear-like module returned, a function putting a replacement back
    into the same container). A tensor, or a tuple/list whose first item is the tensor (vLLM's
    linears return ``(output, output_bias)``); (None, None) otherwise."""
    if isinstance(output, torch.Tensor):
        return (output, _same) if output.is_floating_point() else (None, None)
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor) \
            and output[0].is_floating_point():
        kind = type(output)
        return output[0], lambda new: kind((new, *output[1:]))
    return None, None


def _same(new: torch.Tensor) -> torch.Tensor:
    return new


def logits_of(output: Any) -> torch.Tensor | None:
    """The logits of a root forward's output (a tensor, ``.logits``, or a tuple's first item)."""
    if isinstance(output, torch.Tensor):
        return output
    t = getattr(output, "logits", None)
    if isinstance(t, torch.Tensor):
        return t
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def with_logits(output: Any, logits: torch.Tensor) -> Any:
    """``output`` with its logits replaced (same container type)."""
    if isinstance(output, torch.Tensor):
        return logits
    if isinstance(getattr(output, "logits", None), torch.Tensor):
        try:
            output["logits"] = logits  # transformers ModelOutput: sets key and attribute
        except TypeError:
            output.logits = logits
        return output
    if isinstance(output, tuple):
        return (logits, *output[1:])
    if isinstance(output, list):
        return [logits, *output[1:]]
    return output


def cache_of(kwargs: dict) -> Any:
    """The KV cache passed to the root forward (transformers 4.x: ``past_key_values``; 5.x:
    ``cache``), or None."""
    for key in _CACHE_KWARGS:
        c = kwargs.get(key)
        if c is not None:
            return c
    return None


def fetch(tensors: list[torch.Tensor]) -> list[float]:
    """Every tensor's values, flattened in order, in one device->host transfer per device."""
    if not tensors:
        return []
    by_dev: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dev.setdefault(t.device, []).append(i)
    out: list[list[float]] = [[] for _ in tensors]
    for idxs in by_dev.values():
        parts = [tensors[i].detach().reshape(-1).double() for i in idxs]
        host = torch.cat(parts).cpu().tolist()
        pos = 0
        for i, p in zip(idxs, parts):
            out[i] = host[pos:pos + p.numel()]
            pos += p.numel()
    return [v for vals in out for v in vals]


def nonfinite_counts(t: torch.Tensor) -> torch.Tensor:
    """[NaN count, Inf count] of ``t``, on its device."""
    return torch.stack([torch.isnan(t).sum(), torch.isinf(t).sum()])
