"""The runtime guard: ``with qforensics.guard(model, policy=...) as g: model.generate(...)``.

How a step goes (a step is one top-level forward of the guarded model; with ``generate``, the
prefill and then one step per token):

1. Healthy path. The root forward hook sums the logits on their device and reads that one
   number back: ONE host sync per step, none per layer, and no hook at all on healthy modules
   (``check="logits"``, the default). ``check="modules"`` also keeps a 0-dim on-device flag
   (the output's sum: NaN/Inf propagate into it) for every guarded module and reads them back
   in the same single transfer; it costs a reduction and a hook call per module call.
2. A step whose logits (or flags) are non-finite is rerun once, in "locate" mode: the forward
   runs again with the same arguments (a ``DynamicCache`` is first rolled back by the tokens the
   failed pass appended; a cache that cannot be rolled back disables the rerun), every guarded
   module's output is checked as it is produced (a sync per call, in failing steps only), and
   the first module whose input is finite but whose output is not - the producer - gets its
   fallback output right there, so later modules see repaired inputs. The rerun's output
   replaces the step's output: the caller (``generate``) never sees the NaN.
3. A module that tripped stays "suspect": every later call computes its fallback too and
   returns ``torch.where(isfinite(out), out, fallback)`` on device (no sync); the non-finite
   count of its quantized output joins the step's one transfer, so every trip is counted.
4. Circuit breaker: ``breaker_trips`` trips within ``breaker_window`` steps open the module's
   breaker: from then on it returns only its fallback (incident ``breaker_open``, logged once).
5. Last resort: if the logits are still non-finite (a NaN made by an op the guard cannot fall
   back for, no rerun possible), they are sanitized (NaN -> -1e4, +-Inf -> +-1e4) and an
   incident ``sanitize_logits`` says why; ``on_unrecoverable="raise"`` raises instead.

Fallbacks (qforensics.guard.fallbacks, .layouts): each guarded module is bound at set-up to
the first strategy whose ``can_take(module)`` accepts it: a float weight (``nn.Linear``,
`FakeQuantLinear` on its unquantized input, GPT-2 ``Conv1D``; half precision recomputed in float32
and clamped), ``policy.fallback_weights[name]``, or a quantized layout dequantized once on the
module's first trip. A module no strategy takes is still located; its trip ends in logit
sanitizing, and the guard says at set-up why it has no fallback.

Hooks are global state on the user's modules: they attach in ``__enter__`` and are all removed
in ``__exit__`` (also on exception); a second guard on the same model is refused; nothing is
written onto the user's modules (all state lives here, hooks are bound with functools.partial).
An internal error of the guard is logged once and the guard goes passive; it never crashes the
run it protects.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
from torch import nn

from qforensics.guard.fallbacks import Fallback, choose_fallback, select_guarded
from qforensics.guard.policy import (
    GuardError,
    GuardPolicy,
    GuardStats,
    GuardTripError,
    resolve_policy,
)
from qforensics.guard.steps import HEALTHY, OPEN, STATE_NAMES, StepMachine
from qforensics.incidents import report_incident

__all__ = ["Guard", "GuardError", "GuardPolicy", "GuardStats", "GuardTripError", "guard"]

log = logging.getLogger("qforensics.guard")

_ACTIVE: dict[int, Guard] = {}  # id(model) -> guard: refuse attaching twice
_ACTIVE_LOCK = threading.Lock()


class Guard(StepMachine):
    """A guard session on one model. Create with `guard`; use as a context manager.

    ``stats`` (`GuardStats`) and ``incidents`` (list of dicts) stay readable after exit;
    ``state(name)`` says whether a module is healthy, suspect or breaker-open.
    """

    def __init__(self, model: nn.Module, policy: GuardPolicy) -> None:
        if not isinstance(model, nn.Module):
            raise GuardError(f"guard needs a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.policy = policy.validated()
        self.stats = GuardStats()
        self.incidents: list[dict[str, Any]] = []
        self.names: list[str] = []
        self._modules: list[nn.Module] = []
        self._fallbacks: list[Fallback | None] = []
        self._no_fallback: dict[str, str] = {}  # module -> why it has no fallback
        self._state: list[int] = []
        self._trip_steps: list[collections.deque[int]] = []
        self._root_handles: list[Any] = []
        self._mod_handles: dict[int, Any] = {}
        self._attached = False
        self._failed: str | None = None
        self._check_modules = self.policy.check == "modules"
        self._warned_sanitize = False
        self._said_no_rollback = False
        # per-step state, one step at a time across threads (see StepMachine._on_root_pre)
        self._step_lock = threading.RLock()
        self.step = -1
        self._depth = 0
        self._in_step = False
        self._locating = False
        self._args: tuple = ()
        self._kwargs: dict[str, Any] = {}
        self._cache: Any = None
        self._cache_len: int | None = None
        self._flags: list[tuple[int, torch.Tensor]] = []
        self._counts: list[tuple[int, torch.Tensor]] = []
        self._tripped: set[int] = set()  # modules whose trip this step is already counted
        self._notes: list[str] = []  # why a locate pass could not repair (for the incident)

    # -- set-up / teardown ---------------------------------------------------------------------
    def __enter__(self) -> Guard:
        self.attach()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def attach(self) -> None:
        with _ACTIVE_LOCK:
            if id(self.model) in _ACTIVE:
                raise GuardError(f"a guard is already attached to this {type(self.model).__name__};"
                                 " exit it before attaching another")
            _ACTIVE[id(self.model)] = self
        try:
            chosen = select_guarded(self.model, self.policy.modules)
            if not chosen:
                raise GuardError(f"guard: nothing to guard in {type(self.model).__name__}: no "
                                 "linear-like module matched policy.modules="
                                 f"{self.policy.modules!r}")
            for name, mod in chosen:
                self.names.append(name)
                self._modules.append(mod)
                fb, why = self._choose_fallback(name, mod)
                self._fallbacks.append(fb)
                self._no_fallback[name] = why
                self._state.append(HEALTHY)
                self._trip_steps.append(collections.deque())
            no_fb = [n for n, f in zip(self.names, self._fallbacks) if f is None]
            if no_fb:
                log.warning("qforensics guard: %d guarded module(s) have no fallback (e.g. %s: %s)"
                            "; they are still located, and their trips end in logit sanitizing",
                            len(no_fb), no_fb[0], self._no_fallback[no_fb[0]])
            self._root_handles.append(self.model.register_forward_pre_hook(
                self._on_root_pre, with_kwargs=True, prepend=True))
            # prepend: repair the output before other hooks (capture) see it
            self._root_handles.append(self.model.register_forward_hook(
                self._on_root_post, with_kwargs=True, always_call=True, prepend=True))
            if self._check_modules:
                for i in range(len(self.names)):
                    self._hook(i)
            self._attached = True
            log.debug("qforensics guard: %d modules guarded (check=%s)", len(self.names),
                      self.policy.check)
        except BaseException:
            self._remove_hooks()
            with _ACTIVE_LOCK:
                _ACTIVE.pop(id(self.model), None)
            raise

    def _choose_fallback(self, name: str, module: nn.Module) -> tuple[Fallback | None, str]:
        """The fallback bound to a guarded module at set-up (an engine's guard adds its own
        layouts first), or None and why there is none."""
        return choose_fallback(name, module, self.policy)

    def _hook(self, i: int) -> None:
        if i not in self._mod_handles:
            self._mod_handles[i] = self._modules[i].register_forward_hook(
                partial(self._on_module, i), with_kwargs=True)

    def _unhook(self, i: int) -> None:
        h = self._mod_handles.pop(i, None)
        if h is not None:
            h.remove()

    def _remove_hooks(self) -> None:
        for h in [*self._root_handles, *self._mod_handles.values()]:
            try:
                h.remove()
            except Exception:
                pass
        self._root_handles = []
        self._mod_handles = {}

    def close(self) -> None:
        """Remove every hook and release the model (idempotent)."""
        if not self._attached and not self._root_handles:
            return
        self._attached = False
        try:
            self._remove_hooks()
        finally:
            self._args, self._kwargs, self._cache = (), {}, None
            self._flags, self._counts = [], []
            with _ACTIVE_LOCK:
                if _ACTIVE.get(id(self.model)) is self:
                    del _ACTIVE[id(self.model)]

    @property
    def failed(self) -> str | None:
        """The internal error that made the guard passive, if any."""
        return self._failed

    @property
    def hooks_attached(self) -> int:
        return len(self._root_handles) + len(self._mod_handles)

    @property
    def guarded(self) -> list[tuple[nn.Module, Fallback | None]]:
        """Each guarded module with its fallback (None: it has none), in guard order."""
        return list(zip(self._modules, self._fallbacks))

    def fallback(self, name: str) -> Fallback | None:
        """The fallback strategy bound to guarded module ``name`` (None: it has none)."""
        return self._fallbacks[self._index(name)]

    def no_fallback_reason(self, name: str) -> str:
        """Why guarded module ``name`` has no fallback ("" when it has one)."""
        return self._no_fallback.get(self.names[self._index(name)], "")

    def _index(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise GuardError(f"guard: {name!r} is not a guarded module") from None

    def state(self, name: str) -> str:
        return STATE_NAMES[self._state[self.names.index(name)]]


    # -- trips, breaker, incidents -------------------------------------------------------------
    def _trip(self, i: int, nan: int, inf: int, action: str, detail: str) -> None:
        name = self.names[i]
        self._tripped.add(i)
        self.stats.trips += 1
        self.stats.trips_by_module[name] = self.stats.trips_by_module.get(name, 0) + 1
        if self.stats.trips_by_module[name] == 1:
            what = f"{nan} NaN / {inf} Inf" if nan + inf else "non-finite output"
            log.warning("qforensics guard: %s produced %s at step %d; %s", name, what,
                        self.step, detail)
        self._incident(name, action, nan, inf, detail)

    def _breaker(self, i: int) -> None:
        if self._state[i] == OPEN:
            return
        q = self._trip_steps[i]
        q.append(self.step)
        while q and q[0] <= self.step - self.policy.breaker_window:
            q.popleft()
        if len(q) >= self.policy.breaker_trips:
            self._state[i] = OPEN
            name = self.names[i]
            self.stats.breakers_open.append(name)
            msg = (f"{len(q)} trips within {self.policy.breaker_window} steps; {name} stays on "
                   "its fallback until the guard exits")
            log.warning("qforensics guard: circuit breaker open: %s", msg)
            self._incident(name, "breaker_open", 0, 0, msg)

    def _incident(self, module: str, action: str, nan: int, inf: int, detail: str) -> None:
        self.stats.incidents += 1
        self.incidents.append({"step": self.step, "module": module, "action": action,
                               "nan_count": nan, "inf_count": inf, "detail": detail})
        # a capture attached to the same model registered a sink for it (qforensics.incidents)
        report_incident(self.model, module, action, nan_count=nan, inf_count=inf, detail=detail)

    def _fail(self, exc: BaseException) -> None:
        if self._failed is None:
            self._failed = f"{type(exc).__name__}: {exc}"
            log.error("qforensics guard: internal error (%s); the guard goes passive, the run "
                      "continues", self._failed, exc_info=True)


def guard(model: nn.Module, policy: GuardPolicy | Mapping[str, Any] | None = None,
          **overrides: Any) -> Guard:
    """Guard ``model`` against NaN/Inf from its quantized linears (use as a context manager).

    >>> with qforensics.guard(model) as g:                      # doctest: +SKIP
    ...     out = model.generate(ids, max_new_tokens=32)
    >>> g.stats.trips, g.stats.breakers_open                     # doctest: +SKIP

    ``policy`` is a `GuardPolicy`, a mapping of its fields, or None (defaults); keyword
    ``overrides`` replace single fields (``guard(model, check="modules")``).
    """
    return Guard(model, resolve_policy(policy, overrides))
