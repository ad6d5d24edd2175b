"""Runtime NaN/Inf trip-wire for quantized models: ``with qforensics.guard(model): ...``.

The guard checks the model's logits once per step on the device (one host sync per step, no
sync per layer), finds the producing quantized Linear only when a step went non-finite, repairs
that step by rerunning it with the tripped module on its higher-precision fallback, keeps the
module on a device-side fallback (``torch.where``) from then on, opens a per-module circuit
breaker after repeated trips and sanitizes the logits only as a last resort. Every trip is
counted in ``Guard.stats`` and, when a capture is attached to the model, written into the
trace's ``/incidents`` table. See docs/guard.md for the design and its measured cost.

``qforensics.guard`` is both this package and a callable: ``qforensics.guard(model, ...)`` and
``qforensics.guard.guard(model, ...)`` are the same function (`qforensics.guard.runtime.guard`).
"""

from __future__ import annotations

import sys
import types
from typing import Any

from qforensics.guard.policy import GuardError, GuardPolicy, GuardStats, GuardTripError
from qforensics.guard.runtime import Guard, guard

__all__ = ["Guard", "GuardError", "GuardPolicy", "GuardStats", "GuardTripError", "guard"]


class _CallableModule(types.ModuleType):
    """Lets ``qforensics.guard(model)`` work once the package itself has been imported (Python
    then binds the attribute ``qforensics.guard`` to this package, not to the function)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Guard:
        return guard(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
