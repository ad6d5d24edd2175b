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

Fallback of a guarded module: the higher-precision path, from weights kept aside at set-up.
A `FakeQuantLinear` runs ``F.linear`` on its UNQUANTIZED input with its original weight; an
``nn.Linear`` in float16 / bfloat16 recomputes in float32 (clamped to the output dtype's range);
``policy.fallback_weights`` ({module name: dequantized weight}) supplies weights for modules
whose own weight is quantized. A module without a fallback is still located, and its trip ends
in logit sanitizing.

Hooks are global state on the user's modules: they attach in ``__enter__`` and are all removed
in ``__exit__`` (also on exception); a second guard on the same model is refused; nothing is
written onto the user's modules (all state lives here, hooks are bound with functools.partial).
An internal error of the guard is logged once and the guard goes passive; it never crashes the
run it protects.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from functools import partial
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from qforensics.errors import QForensicsError

__all__ = ["Guard", "GuardError", "GuardPolicy", "GuardStats", "GuardTripError", "guard"]

log = logging.getLogger(__name__)

_ACTIVE: dict[int, Guard] = {}  # id(model) -> guard: refuse attaching twice
_ACTIVE_LOCK = threading.Lock()

HEALTHY, SUSPECT, OPEN = 0, 1, 2
_STATE_NAMES = {HEALTHY: "healthy", SUSPECT: "suspect", OPEN: "breaker-open"}
LOGITS = "(logits)"  # module name of step-level incidents


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


# -- fallbacks ------------------------------------------------------------------------------
def _linear_fallback(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor,
                     out_dtype: torch.dtype) -> torch.Tensor:
    low = (torch.float16, torch.bfloat16)
    if x.dtype in low or weight.dtype in low or out_dtype in low:
        y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    else:
        y = F.linear(x.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype))
    if out_dtype in low:
        lim = torch.finfo(out_dtype).max
        y = y.clamp(-lim, lim)
    return y.to(out_dtype)


def _conv1d_fallback(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor,
                     out_dtype: torch.dtype) -> torch.Tensor:
    # transformers' GPT-2 Conv1D: weight is [in, out]
    return _linear_fallback(weight.t(), bias, x, out_dtype)


def _make_fallback(name: str, mod: nn.Module, policy: GuardPolicy
                   ) -> Callable[[torch.Tensor, torch.dtype], torch.Tensor] | None:
    given = (policy.fallback_weights or {}).get(name)
    weight = given if given is not None else getattr(mod, "weight", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() != 2:
        return None
    weight = weight.detach()
    if policy.copy_weights and given is None:
        weight = weight.clone()
    bias = getattr(mod, "bias", None)
    bias = bias.detach() if isinstance(bias, torch.Tensor) else None
    if type(mod).__name__ == "Conv1D" and given is None:
        return partial(_conv1d_fallback, weight, bias)
    return partial(_linear_fallback, weight, bias)


def _select(model: nn.Module, spec: Any) -> list[tuple[str, nn.Module]]:
    from qforensics.hooks.modules import is_linear_like, select_modules
    from qforensics.quant.model import FakeQuantLinear

    named = [(n, m) for n, m in model.named_modules() if m is not model]
    if callable(spec) and not isinstance(spec, str):
        return [(n, m) for n, m in named if spec(n, m)]
    if isinstance(spec, str) and spec in ("auto", "quantized", "linear"):
        linear = [(n, m) for n, m in named if is_linear_like(m)]
        if spec == "linear":
            return linear
        qnames = {n for n, _, k in select_modules(model, "linear") if k == "quantized_linear"}
        quant = [(n, m) for n, m in linear if isinstance(m, FakeQuantLinear) or n in qnames]
        return quant if quant or spec == "quantized" else linear
    names = {spec} if isinstance(spec, str) else set(spec)
    found = [(n, m) for n, m in named if n in names]
    missing = names - {n for n, _ in found}
    if missing:
        raise GuardError(f"guard: no module named {sorted(missing)[0]!r} in "
                         f"{type(model).__name__} ({len(missing)} of {len(names)} names missing)")
    return found


# -- helpers --------------------------------------------------------------------------------
def _input_of(args: tuple, kwargs: dict) -> torch.Tensor | None:
    x = args[0] if args else kwargs.get("input", kwargs.get("x"))
    return x if isinstance(x, torch.Tensor) and x.is_floating_point() else None


def _logits_of(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    t = getattr(output, "logits", None)
    if isinstance(t, torch.Tensor):
        return t
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def _with_logits(output: Any, logits: torch.Tensor) -> Any:
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


_CACHE_KWARGS = ("past_key_values", "cache", "past_key_value", "layer_past")


def _cache_of(kwargs: dict) -> Any:
    """The KV cache passed to the root forward (transformers 4.x: ``past_key_values``; 5.x:
    ``cache``), or None."""
    for key in _CACHE_KWARGS:
        c = kwargs.get(key)
        if c is not None:
            return c
    return None


def _fetch(tensors: list[torch.Tensor]) -> list[float]:
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


def _nonfinite_counts(t: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.isnan(t).sum(), torch.isinf(t).sum()])


# -- the guard ------------------------------------------------------------------------------
class Guard:
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
        self._fallbacks: list[Callable[..., torch.Tensor] | None] = []
        self._state: list[int] = []
        self._trip_steps: list[collections.deque[int]] = []
        self._root_handles: list[Any] = []
        self._mod_handles: dict[int, Any] = {}
        self._attached = False
        self._failed: str | None = None
        self._check_modules = self.policy.check == "modules"
        self._warned_sanitize = False
        # per-step state
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
            chosen = _select(self.model, self.policy.modules)
            if not chosen:
                raise GuardError(f"guard: nothing to guard in {type(self.model).__name__}: no "
                                 "linear-like module matched policy.modules="
                                 f"{self.policy.modules!r}")
            for name, mod in chosen:
                self.names.append(name)
                self._modules.append(mod)
                self._fallbacks.append(_make_fallback(name, mod, self.policy))
                self._state.append(HEALTHY)
                self._trip_steps.append(collections.deque())
            no_fb = [n for n, f in zip(self.names, self._fallbacks) if f is None]
            if no_fb:
                log.warning("qforensics guard: %d guarded module(s) have no float weight to fall "
                            "back on (e.g. %s); pass policy.fallback_weights", len(no_fb), no_fb[0])
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

    def state(self, name: str) -> str:
        return _STATE_NAMES[self._state[self.names.index(name)]]

    # -- module hook (hot path for suspect modules and check="modules") -----------------------
    def _on_module(self, i: int, module: nn.Module, args: tuple, kwargs: dict,
                   output: Any) -> Any:
        if self._failed or not isinstance(output, torch.Tensor) or not output.is_floating_point():
            return None
        try:
            st = self._state[i]
            out = output
            fb = self._fallbacks[i]
            if st != HEALTHY and fb is not None:
                x = _input_of(args, kwargs)
                if x is not None:
                    alt = fb(x, output.dtype)
                    if self._in_step:  # NaN, Inf of the quantized output; non-finite inputs
                        self._counts.append((i, torch.cat([
                            _nonfinite_counts(output), (~torch.isfinite(x)).sum().reshape(1)])))
                    out = alt if st == OPEN else torch.where(torch.isfinite(output), output, alt)
                    self.stats.fallback_calls += 1
            elif self._check_modules and self._in_step and not self._locating:
                x = _input_of(args, kwargs)
                s_in = x.sum(dtype=torch.float32) if x is not None else output.new_zeros(())
                self._flags.append((i, torch.stack([s_in.float(), output.sum(dtype=torch.float32)])))
            if self._locating:
                out = self._locate(i, args, kwargs, output, out)
            return out if out is not output else None
        except Exception as exc:
            self._fail(exc)
            return None

    def _locate(self, i: int, args: tuple, kwargs: dict, raw: torch.Tensor,
                out: torch.Tensor) -> torch.Tensor:
        """Locate mode (failing steps only): check this call now; repair a producer."""
        self.stats.host_syncs += 1
        if bool(torch.isfinite(out).all()):
            return out
        x = _input_of(args, kwargs)
        fb = self._fallbacks[i]
        name = self.names[i]
        if x is not None and not bool(torch.isfinite(x).all()):
            if not self._notes:
                self._notes.append(f"non-finite input to {name} from an op the guard does not "
                                   "cover")
            return out
        if fb is None or x is None:
            self._notes.append(f"{name} produced it and has no fallback")
            return out
        if self._state[i] != HEALTHY:  # fallback already applied and still non-finite
            self._notes.append(f"the fallback of {name} is non-finite too")
            return out
        nan, inf = (int(v) for v in _nonfinite_counts(raw).tolist())
        self._trip(i, nan, inf, "fallback", "producer located in the rerun of the step; "
                   "its fallback output is used from now on")
        self._state[i] = SUSPECT if self._state[i] == HEALTHY else self._state[i]
        self._breaker(i)
        alt = fb(x, raw.dtype)
        self.stats.fallback_calls += 1
        return alt if self._state[i] == OPEN else torch.where(torch.isfinite(raw), raw, alt)

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
        try:
            from qforensics.hooks.capture import active_capture

            cap = active_capture(self.model)
            if cap is not None:
                cap.record_incident(module, action, nan_count=nan, inf_count=inf, detail=detail)
        except Exception as exc:  # never let reporting break the run
            log.warning("qforensics guard: could not write an incident to the capture (%s)", exc)

    def _fail(self, exc: BaseException) -> None:
        if self._failed is None:
            self._failed = f"{type(exc).__name__}: {exc}"
            log.error("qforensics guard: internal error (%s); the guard goes passive, the run "
                      "continues", self._failed, exc_info=True)

    # -- step boundaries -----------------------------------------------------------------------
    def _on_root_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._depth += 1
        if self._depth > 1 or self._failed:
            return
        try:
            self.step += 1
            self.stats.steps += 1
            self._in_step = True
            self._args, self._kwargs = args, kwargs
            self._flags, self._counts, self._notes = [], [], []
            self._tripped = set()
            self._cache = _cache_of(kwargs)
            self._cache_len = None
            if self._cache is not None and callable(getattr(self._cache, "get_seq_length", None)):
                self._cache_len = int(self._cache.get_seq_length())
        except Exception as exc:
            self._fail(exc)

    def _on_root_post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        self._depth = max(0, self._depth - 1)
        if self._depth > 0 or not self._in_step:
            return None
        try:
            if self._failed or output is None:  # the forward raised: nothing to check
                return None
            return self._end_step(module, output)
        except GuardTripError:
            raise
        except Exception as exc:
            self._fail(exc)
            return None
        finally:
            self._in_step = False
            self._locating = False
            self._args, self._kwargs, self._cache = (), {}, None
            self._flags, self._counts = [], []

    def _read(self, logits: torch.Tensor | None) -> tuple[bool, list[tuple[int, bool]]]:
        """One transfer: are the logits finite, which flagged modules (check="modules") had a
        non-finite output (and was their input finite); counts the suspect modules' trips."""
        tensors: list[torch.Tensor] = []
        if logits is not None:
            tensors.append(logits.detach().sum(dtype=torch.float32))
        tensors += [t for _, t in self._flags]
        tensors += [t for _, t in self._counts]
        vals = _fetch(tensors)
        self.stats.host_syncs += 1
        pos = 0
        ok = True
        if logits is not None:
            ok = math.isfinite(vals[0])
            pos = 1
        bad_flags = []  # (module, its input was finite): non-finite outputs, in call order
        for i, _ in self._flags:
            if not math.isfinite(vals[pos + 1]):
                bad_flags.append((i, math.isfinite(vals[pos])))
            pos += 2
        for i, _ in self._counts:
            nan, inf, bad_in = int(vals[pos]), int(vals[pos + 1]), int(vals[pos + 2])
            pos += 3
            # a non-finite input is propagation, not this module's trip
            if nan + inf and not bad_in and i not in self._tripped:
                opened = self._state[i] == OPEN
                self._trip(i, nan, inf, "breaker_fallback" if opened else "fallback",
                           "breaker open: the fallback output was used" if opened else
                           "the fallback replaced its non-finite outputs")
                self._breaker(i)
        self._flags, self._counts = [], []
        if not ok and logits is not None:  # the sum can overflow: check exactly
            self.stats.host_syncs += 1
            ok = bool(torch.isfinite(logits).all())
        return ok, bad_flags

    def _rollback_cache(self) -> str | None:
        """Undo what the failed pass appended to the KV cache; None when done, else why not."""
        cache = self._cache
        if cache is None:
            return None
        if isinstance(cache, (tuple, list)):
            return None  # legacy tuple cache: the forward returns a new one, input untouched
        if self._cache_len is None or not callable(getattr(cache, "crop", None)):
            return f"the KV cache ({type(cache).__name__}) cannot be rolled back"
        added = int(cache.get_seq_length()) - self._cache_len
        if added > 0:
            cache.crop(-added)  # negative: remove that many tokens (transformers 4.x and 5.x)
        if int(cache.get_seq_length()) != self._cache_len:
            return f"rolling back the KV cache ({type(cache).__name__}) failed"
        return None

    def _end_step(self, module: nn.Module, output: Any) -> Any:
        logits = _logits_of(output)
        ok, bad_flags = self._read(logits)
        if ok and not bad_flags:
            return None
        replaced = False
        why = ""
        if self.policy.rerun:
            for attempt in range(self.policy.max_reruns):
                why = self._rollback_cache() or ""
                if why:
                    break
                n_tripped = len(self._tripped)
                self._notes = []
                for i in range(len(self.names)):
                    self._hook(i)
                self._locating = True
                try:
                    output = module.forward(*self._args, **self._kwargs)
                except Exception as exc:
                    why = f"the rerun raised {type(exc).__name__}: {exc}"
                    log.warning("qforensics guard: %s", why)
                    break
                finally:
                    self._locating = False
                    if not self._check_modules:
                        for i in range(len(self.names)):
                            if self._state[i] == HEALTHY:
                                self._unhook(i)
                replaced = True
                self.stats.reruns += 1
                logits = _logits_of(output)
                ok, _ = self._read(logits)
                if ok:
                    self.stats.repaired_steps += 1
                    return output
                why = "; ".join(self._notes) or "the rerun is still non-finite"
                if len(self._tripped) == n_tripped:
                    break  # no new producer found: another rerun cannot help
        else:
            why = "rerun disabled by the policy"
        if not replaced:
            # check="modules": the first flagged call with a finite input is the producer;
            # it runs its fallback from the next call on
            producers = [i for i, in_ok in bad_flags if in_ok]
            if producers:
                i = producers[0]
                if self._state[i] == HEALTHY and self._fallbacks[i] is not None:
                    self._trip(i, 0, 0, "fallback", "caught at the step end (counts unknown); "
                               "its fallback output is used from the next call on")
                    self._state[i] = SUSPECT
                    self._hook(i)
                    self._breaker(i)
        if why.startswith("the KV cache") or why.startswith("rolling back"):
            if not self._check_modules:  # locate by flags from now on
                self._check_modules = True
                for i in range(len(self.names)):
                    self._hook(i)
        if logits is None or bool(torch.isfinite(logits).all()):
            return output if replaced else None
        return self._sanitize(output, logits, why)

    def _sanitize(self, output: Any, logits: torch.Tensor, why: str) -> Any:
        nan, inf = (int(v) for v in _nonfinite_counts(logits).tolist())
        self.stats.host_syncs += 1
        detail = f"logits sanitized: {why}" if why else "logits sanitized"
        if self.policy.on_unrecoverable == "raise":
            self._incident(LOGITS, "sanitize_logits", nan, inf, "raised: " + why)
            raise GuardTripError(f"step {self.step}: {nan} NaN / {inf} Inf logits after every "
                                 f"repair ({why})")
        self.stats.sanitized_steps += 1
        self._incident(LOGITS, "sanitize_logits", nan, inf, detail)
        if not self._warned_sanitize:
            self._warned_sanitize = True
            log.warning("qforensics guard: step %d: %d NaN / %d Inf logits; %s (last resort; "
                        "every later one is counted in guard.stats)", self.step, nan, inf, detail)
        v = float(self.policy.sanitize_value)
        if logits.is_floating_point():
            v = min(v, torch.finfo(logits.dtype).max)
        clean = torch.nan_to_num(logits, nan=-v, posinf=v, neginf=-v)
        return _with_logits(output, clean)


def guard(model: nn.Module, policy: GuardPolicy | Mapping[str, Any] | None = None,
          **overrides: Any) -> Guard:
    """Guard ``model`` against NaN/Inf from its quantized linears (use as a context manager).

    >>> with qforensics.guard(model) as g:                      # doctest: +SKIP
    ...     out = model.generate(ids, max_new_tokens=32)
    >>> g.stats.trips, g.stats.breakers_open                     # doctest: +SKIP

    ``policy`` is a `GuardPolicy`, a mapping of its fields, or None (defaults); keyword
    ``overrides`` replace single fields (``guard(model, check="modules")``).
    """
    if policy is None:
        pol = GuardPolicy()
    elif isinstance(policy, GuardPolicy):
        pol = policy
    elif isinstance(policy, Mapping):
        known = {f.name for f in fields(GuardPolicy)}
        bad = sorted(set(policy) - known)
        if bad:
            raise GuardError(f"unknown guard policy field {bad[0]!r}; known: {sorted(known)}")
        pol = GuardPolicy(**policy)
    else:
        raise GuardError(f"policy must be a GuardPolicy or a mapping, not {type(policy).__name__}")
    if overrides:
        known = {f.name for f in fields(GuardPolicy)}
        bad = sorted(set(overrides) - known)
        if bad:
            raise GuardError(f"unknown guard policy field {bad[0]!r}; known: {sorted(known)}")
        pol = replace(pol, **overrides)
    return Guard(model, pol)
