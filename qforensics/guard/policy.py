"""Guard policy, counters and errors: what the guard checks, how it repairs, what it counted."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal

import torch
from torch import nn

from qforensics.errors import QForensicsError

__all__ = ["GuardError", "GuardPolicy", "GuardStats", "GuardTripError", "resolve_policy"]


class GuardError(QForensicsError):
    """The guard cannot be set up (attached twice, nothing to guard, bad policy)."""


class GuardTripError(RuntimeError):
    """Raised from the forward under ``on_unrecoverable="raise"`` when a step stays
    non-finite after every repair. Not a user error: the run itself failed."""


ModuleSpec = str | Iterable[str] | Callable[[str, nn.Module], bool]


@dataclass(frozen=True)
class GuardPolicy:
    """What the guard checks and how it repairs.

    check: ``"logits"`` (one on-device sum of the logits per step; modules are located only
        in failing steps) or ``"modules"`` (also an on-device flag per guarded module call).
    modules: ``"auto"`` (quantized linears - `FakeQuantLinear` and library quantized linears -
        or, when the model has none, every linear-like module), ``"quantized"``, ``"linear"``,
        an iterable of module names, or a callable ``(name, module) -> bool``.
    rerun: repair a failing step by rerunning it with the producer on its fallback.
    max_reruns: reruns per step (each can repair the producers it meets).
    breaker_trips / breaker_window: that many trips of one module within that many steps open
        its breaker (it then stays on the fallback until the guard exits).
    on_unrecoverable: ``"sanitize"`` the logits, or ``"raise"`` `GuardTripError`.
    fallback_weights: {module name: higher-precision weight [out, in]} for modules whose own
        weight is quantized (e.g. the originals a weight quantization replaced).
    copy_weights: keep a private copy of each guarded weight at set-up instead of a reference.
    sanitize_value: magnitude that replaces NaN (negative) and +-Inf in sanitized logits.
    """

    check: Literal["logits", "modules"] = "logits"
    modules: Any = "auto"
    rerun: bool = True
    max_reruns: int = 2
    breaker_trips: int = 3
    breaker_window: int = 16
    on_unrecoverable: Literal["sanitize", "raise"] = "sanitize"
    fallback_weights: Mapping[str, torch.Tensor] | None = None
    copy_weights: bool = False
    sanitize_value: float = 1e4

    def validated(self) -> GuardPolicy:
        if self.check not in ("logits", "modules"):
            raise GuardError(f"guard policy check must be 'logits' or 'modules', not {self.check!r}")
        if self.on_unrecoverable not in ("sanitize", "raise"):
            raise GuardError("guard policy on_unrecoverable must be 'sanitize' or 'raise', "
                             f"not {self.on_unrecoverable!r}")
        for name in ("max_reruns", "breaker_trips", "breaker_window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "max_reruns" else 1):
                raise GuardError(f"guard policy {name} must be a positive integer, got {v!r}")
        if not (isinstance(self.sanitize_value, (int, float)) and
                math.isfinite(self.sanitize_value) and self.sanitize_value > 0):
            raise GuardError("guard policy sanitize_value must be a finite positive number")
        return self


@dataclass
class GuardStats:
    """Counters of one guard session (``Guard.stats``); ``as_dict()`` for JSON."""

    steps: int = 0
    trips: int = 0  # (module, step) pairs whose quantized output was non-finite
    trips_by_module: dict[str, int] = field(default_factory=dict)
    fallback_calls: int = 0  # calls that computed their fallback (suspect or breaker-open)
    reruns: int = 0
    repaired_steps: int = 0  # non-finite steps whose rerun came out finite
    sanitized_steps: int = 0
    breakers_open: list[str] = field(default_factory=list)
    incidents: int = 0
    host_syncs: int = 0  # device -> host reads (one per healthy step)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_fields(names: Iterable[str]) -> None:
    known = {f.name for f in fields(GuardPolicy)}
    bad = sorted(set(names) - known)
    if bad:
        raise GuardError(f"unknown guard policy field {bad[0]!r}; known: {sorted(known)}")


def resolve_policy(policy: GuardPolicy | Mapping[str, Any] | None,
                   overrides: Mapping[str, Any] | None = None) -> GuardPolicy:
    """A validated `GuardPolicy` from a policy, a mapping of its fields or None (the defaults),
    with keyword ``overrides`` replacing single fields."""
    if policy is None:
        pol = GuardPolicy()
    elif isinstance(policy, GuardPolicy):
        pol = policy
    elif isinstance(policy, Mapping):
        _check_fields(policy)
        pol = GuardPolicy(**policy)
    else:
        raise GuardError(f"policy must be a GuardPolicy or a mapping, not {type(policy).__name__}")
    if overrides:
        _check_fields(overrides)
        pol = replace(pol, **overrides)
    return pol.validated()
