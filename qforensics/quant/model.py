"""Apply fake-quant schemes to a model: weights in place (restorable), activations by hooks.

- `quantize_weights`: overwrite the weight of every matching ``nn.Linear`` with its fake-quant
  value, in place (same storage, so references and tied parameters see it), and return a
  `WeightBackup` whose ``restore()`` copies the originals back bit-identically. Default:
  ``lm_head`` is excluded (SmolLM2 ties it to the token embedding).
- `quantize_activations`: a context manager that fake-quantizes the input of every matching
  ``nn.Linear`` through forward pre-hooks. Hooks are global state on the user's modules: they
  are attached in ``__enter__`` and every handle is removed in ``__exit__``, also when the
  forward raises. Nothing is ever written onto the user's modules.
- `collect_input_absmax`: one calibration pass that records each Linear's per-input-channel
  activation absmax (for salient-channel selection), hooks removed afterwards.

Module names are those of ``model.named_modules()``. An exclude pattern matches a name when it
equals the name, is a dotted suffix of it (``"lm_head"`` matches ``"model.lm_head"``), or
matches it as an ``fnmatch`` glob (``"*.mlp.*"``).
"""

from __future__ import annotations

import fnmatch
import functools
import logging
from types import TracebackType
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from qforensics.quant.errors import QuantApplyError
from qforensics.quant.salient import select_salient_channels
from qforensics.quant.scheme import QuantScheme, parse_scheme

__all__ = [
    "ActivationQuant",
    "WeightBackup",
    "collect_input_absmax",
    "find_linears",
    "quantize_activations",
    "quantize_weights",
]

log = logging.getLogger(__name__)


def _excluded(name: str, patterns: Sequence[str]) -> bool:
    return any(
        name == p or name.endswith("." + p) or fnmatch.fnmatchcase(name, p) for p in patterns
    )


def find_linears(
    model: nn.Module, exclude: Sequence[str] = ()
) -> list[tuple[str, nn.Linear]]:
    """``(name, module)`` of every ``nn.Linear`` in ``model`` not matched by ``exclude``."""
    if isinstance(exclude, str):
        exclude = (exclude,)
    return [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and not _excluded(name, exclude)
    ]


class WeightBackup:
    """Original weights of the Linears `quantize_weights` changed; ``restore()`` puts them back.

    Also a context manager: ``with quantize_weights(model, "int4-g128"): ...`` restores on exit.
    ``restore()`` is idempotent. ``modules`` lists the quantized module names.
    """

    def __init__(self, modules: tuple[str, ...], saved: list[tuple[nn.Parameter, torch.Tensor]]):
        self.modules = modules
        self._saved = saved

    @property
    def restored(self) -> bool:
        return not self._saved

    def restore(self) -> None:
        with torch.no_grad():
            while self._saved:
                param, original = self._saved.pop()
                param.copy_(original)

    def __enter__(self) -> WeightBackup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.restore()

    def __repr__(self) -> str:
        state = "restored" if self.restored else "active"
        return f"<WeightBackup {len(self.modules)} modules, {state}>"


def quantize_weights(
    model: nn.Module,
    scheme: QuantScheme | str,
    *,
    exclude: Sequence[str] = ("lm_head",),
    act_absmax: Mapping[str, torch.Tensor] | None = None,
) -> WeightBackup:
    """Fake-quantize, in place, the weight of every ``nn.Linear`` not matched by ``exclude``.

    ``scheme`` is a weight scheme or spec string (``"int4-g128"``). A scheme with salient
    protection needs ``act_absmax`` from `collect_input_absmax`, one entry per quantized module.
    A weight shared by several Linears is quantized once. Returns the `WeightBackup`.
    """
    scheme = parse_scheme(scheme, "weights")
    linears = find_linears(model, exclude)
    if not linears:
        raise QuantApplyError(
            f"no nn.Linear to quantize in {type(model).__name__} (exclude={list(exclude)!r}); "
            "check the model and the exclude patterns"
        )
    if scheme.keep_salient is not None:
        if act_absmax is None:
            raise QuantApplyError(
                f"{scheme} keeps salient channels and needs calibration stats: pass "
                "act_absmax=collect_input_absmax(model, calibration_input)"
            )
        missing = [name for name, _ in linears if name not in act_absmax]
        if missing:
            raise QuantApplyError(
                f"act_absmax has no entry for {len(missing)} module(s), e.g. {missing[0]!r}; "
                "collect it from the same model with collect_input_absmax"
            )
    saved: list[tuple[nn.Parameter, torch.Tensor]] = []
    seen: set[int] = set()
    names: list[str] = []
    backup = WeightBackup((), saved)
    try:
        with torch.no_grad():
            for name, mod in linears:
                param = mod.weight
                if id(param) in seen:
                    continue
                seen.add(id(param))
                salient = None
                if scheme.keep_salient is not None:
                    assert act_absmax is not None
                    salient = select_salient_channels(act_absmax[name], scheme.keep_salient)
                quantized = scheme.fake_quant(param.detach(), salient)
                saved.append((param, param.detach().clone()))
                param.copy_(quantized)
                names.append(name)
    except BaseException:
        backup.restore()
        raise
    backup.modules = tuple(names)
    log.debug("quantized %d Linear weights with %s", len(names), scheme)
    return backup


def _quantize_input(
    scheme: QuantScheme, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
        return (scheme.fake_quant(args[0]), *args[1:]), kwargs
    x = kwargs.get("input")
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return args, {**kwargs, "input": scheme.fake_quant(x)}
    return None


class ActivationQuant:
    """Context manager from `quantize_activations`: fake-quant every matching Linear's input.

    Hooks attach in ``__enter__`` and are all removed in ``__exit__`` (also on exception). One
    instance cannot be entered twice at once; nesting different instances stacks their effects.
    """

    def __init__(self, model: nn.Module, scheme: QuantScheme, exclude: Sequence[str]):
        self.model = model
        self.scheme = scheme
        self.exclude = tuple(exclude)
        self.modules: tuple[str, ...] = ()
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._active = False

    def __enter__(self) -> ActivationQuant:
        if self._active:
            raise QuantApplyError(f"activation quantization {self.scheme} is already active")
        linears = find_linears(self.model, self.exclude)
        if not linears:
            raise QuantApplyError(
                f"no nn.Linear to hook in {type(self.model).__name__} "
                f"(exclude={list(self.exclude)!r})"
            )
        hook = functools.partial(_quantize_input, self.scheme)
        try:
            for _, mod in linears:
                self._handles.append(mod.register_forward_pre_hook(hook, with_kwargs=True))
        except BaseException:
            self._remove()
            raise
        self.modules = tuple(name for name, _ in linears)
        self._active = True
        return self

    def _remove(self) -> None:
        while self._handles:
            self._handles.pop().remove()
        self._active = False

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._remove()


def quantize_activations(
    model: nn.Module, scheme: QuantScheme | str, *, exclude: Sequence[str] = ()
) -> ActivationQuant:
    """Context manager fake-quantizing the input of every ``nn.Linear`` not in ``exclude``.

    ``with quantize_activations(model, "fp8-e4m3-nosat"): model(ids)`` reproduces the
    non-saturating FP8 failure: any Linear input beyond ±448 becomes NaN.
    """
    return ActivationQuant(model, parse_scheme(scheme, "activations"), exclude)


def _record_absmax(
    name: str, store: dict[str, torch.Tensor], module: nn.Module, args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.numel() == 0:
        return
    amax = x.detach().abs().reshape(-1, x.shape[-1]).amax(dim=0).float()
    prev = store.get(name)
    # fmax would drop a NaN; keep it visible (NaN wins) so salient selection sees that channel.
    store[name] = amax if prev is None else torch.maximum(prev, amax)


def collect_input_absmax(
    model: nn.Module,
    inputs: Callable[[], Any] | Mapping[str, Any] | Any,
    *,
    exclude: Sequence[str] = (),
) -> dict[str, torch.Tensor]:
    """Per-input-channel absmax of every Linear's input over one calibration run.

    ``inputs`` is a callable run with no arguments (e.g. ``lambda: model.generate(ids)``), a
    mapping passed as ``model(**inputs)``, or anything else passed as ``model(inputs)``. Runs
    under ``torch.no_grad()``. Returns ``{module name: float32 CPU tensor [K]}`` (max over all
    tokens and calls) for every Linear that ran; hooks are removed afterwards, also on error.
    """
    store: dict[str, torch.Tensor] = {}
    handles = []
    try:
        for name, mod in find_linears(model, exclude):
            hook = functools.partial(_record_absmax, name, store)
            handles.append(mod.register_forward_pre_hook(hook, with_kwargs=True))
        with torch.no_grad():
            if callable(inputs) and not isinstance(inputs, (nn.Module, torch.Tensor)):
                inputs()
            elif isinstance(inputs, Mapping):
                model(**inputs)
            else:
                model(inputs)
    finally:
        for handle in handles:
            handle.remove()
    return {name: t.cpu() for name, t in store.items()}



class FakeQuantLinear(nn.Linear):
    """An nn.Linear whose forward quantizes its input inside the GEMM, as a real FP8 / INT8
    kernel does. Capture hooks therefore see the finite input and the non-finite output, and the
    analyzer blames this module as the producer (what a real quantized kernel would look like).
    It shares the original module's parameters; `emulate_quantized_linears` swaps it in."""

    def __init__(self, base: nn.Linear, scheme: QuantScheme) -> None:
        nn.Module.__init__(self)
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.scheme = scheme
        self.qforensics_quant = {"format": str(scheme), "target": "activations",
                                 "bits": scheme.bits if hasattr(scheme, "bits") else 8}

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - torch's name
        return nn.functional.linear(self.scheme.fake_quant(input), self.weight, self.bias)


class QuantizedLinears:
    """Context manager from `emulate_quantized_linears`: swaps every matching nn.Linear for a
    FakeQuantLinear sharing its parameters, and swaps the originals back on exit."""

    def __init__(self, model: nn.Module, scheme: QuantScheme, exclude: Sequence[str]):
        self.model = model
        self.scheme = scheme
        self.exclude = tuple(exclude)
        self._swapped: list[tuple[nn.Module, str, nn.Module]] = []

    def __enter__(self) -> "QuantizedLinears":
        if self._swapped:
            raise QuantApplyError(f"quantized linears {self.scheme} already active")
        linears = [(n, m) for n, m in find_linears(self.model, self.exclude)
                   if type(m) is nn.Linear]
        if not linears:
            raise QuantApplyError(f"no nn.Linear to swap in {type(self.model).__name__}")
        named = dict(self.model.named_modules())
        try:
            for name, mod in linears:
                parent_name, _, attr = name.rpartition(".")
                parent = named[parent_name] if parent_name else self.model
                setattr(parent, attr, FakeQuantLinear(mod, self.scheme))
                self._swapped.append((parent, attr, mod))
        except BaseException:
            self._restore()
            raise
        return self

    def _restore(self) -> None:
        while self._swapped:
            parent, attr, mod = self._swapped.pop()
            setattr(parent, attr, mod)

    def __exit__(self, *exc: object) -> None:
        self._restore()


def emulate_quantized_linears(
    model: nn.Module, scheme: QuantScheme | str, *, exclude: Sequence[str] = ()
) -> QuantizedLinears:
    """Run every nn.Linear (not in `exclude`) as a quantized-activation GEMM under `scheme`.

    Unlike `quantize_activations` (forward pre-hooks, which change the input every hook sees),
    the quantization happens inside the module, like a real FP8/INT8 kernel.
    """
    return QuantizedLinears(model, parse_scheme(scheme, "activations"), exclude)
