"""The vLLM guard on row-parallel layers under tensor parallelism.

A row-parallel layer (vLLM's ``RowParallelLinear``: ``o_proj``, ``down_proj``) splits its input
dimension over the ranks; each rank's quantization method computes a partial output from its
shard, and vLLM's all-reduce inside the layer's forward sums the partials. A NaN from one rank's
shard is therefore in every rank's output by the time a forward hook sees it, and a fallback
there would have to join a collective the other ranks never enter.

So the guard steps in one level lower, where the partial is still this rank's own:
`PreReduceMethod` stands in for the layer's ``quant_method`` and hands each partial to the
guard (``VllmGuard.on_partial``) before vLLM reduces it. A rank whose partial is non-finite on a
finite input trips and computes that partial from its dense shard; the all-reduce then sums
repaired partials, with no collective added. The other ranks have nothing to do.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from qforensics.engines.vllm_fallbacks import local_output, parallel_kind

__all__ = ["PreReduceMethod", "install", "needs_pre_reduce", "uninstall"]


def needs_pre_reduce(module: nn.Module) -> bool:
    """A row-parallel layer sharded over more than one rank that all-reduces in its forward."""
    return (parallel_kind(module) == "row" and int(getattr(module, "tp_size", 1) or 1) > 1
            and not local_output(module))


class PreReduceMethod:
    """Stands in for a layer's quantization method: ``apply`` runs the method, then gives the
    guard the partial output (``on_partial(i, x, partial) -> partial``). Every other attribute is
    the method's own; ``inner`` is the method itself."""

    def __init__(self, inner: Any, on_partial: Any, index: int) -> None:
        self.inner = inner
        self.on_partial = on_partial
        self._index = index

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["inner"], name)

    def apply(self, layer: nn.Module, x: Any, bias: Any = None) -> Any:
        out = self.inner.apply(layer, x, bias)
        return self.on_partial(self._index, layer, x, out)


def install(guard: Any) -> list[tuple[nn.Module, Any]]:
    """Put `PreReduceMethod` in front of each guarded pre-reduce layer's method; returns
    (layer, its own method) pairs to put back."""
    put = []
    for i, (mod, fb) in enumerate(guard.guarded):
        if getattr(fb, "pre_reduce", False):
            own = mod.quant_method
            mod.quant_method = PreReduceMethod(own, guard.on_partial, i)
            put.append((mod, own))
    return put


def uninstall(put: list[tuple[nn.Module, Any]]) -> None:
    for mod, own in put:
        if isinstance(mod.quant_method, PreReduceMethod):
            mod.quant_method = own
