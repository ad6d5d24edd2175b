"""The guard's step state machine: what happens in one step of the guarded model.

A step is one top-level forward of the guarded model (with ``generate``: the prefill, then one
step per token). The root pre-hook opens it; the root post-hook reads the logits (and, with
``check="modules"``, every guarded module's on-device flag) in ONE device->host transfer, and a
non-finite step is rerun in locate mode: every guarded module's output is checked as it is
produced, and the first module whose input is finite and whose output is not (the producer)
gets its fallback on the spot. Suspect modules keep running their fallback through
``torch.where`` on device; a module that trips too often has its breaker opened; the logits
are sanitized only as the last resort. `Guard` (qforensics.guard.runtime) owns the set-up,
the hooks and the incidents; this class is the part that runs inside a forward.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from qforensics.guard.cache import cache_length, rollback, why_not_croppable
from qforensics.guard.outputs import (
    cache_of,
    fetch,
    input_of,
    logits_of,
    nonfinite_counts,
    split_output,
    with_logits,
)
from qforensics.guard.policy import GuardTripError

__all__ = ["HEALTHY", "KV_CACHE", "LOGITS", "OPEN", "STATE_NAMES", "SUSPECT", "StepMachine"]

log = logging.getLogger("qforensics.guard")

HEALTHY, SUSPECT, OPEN = 0, 1, 2
STATE_NAMES = {HEALTHY: "healthy", SUSPECT: "suspect", OPEN: "breaker-open"}
LOGITS = "(logits)"  # module name of step-level incidents
KV_CACHE = "(kv-cache)"  # module name of cache incidents


class StepMachine:
    """Per-step logic of `Guard` (a base class: the attributes it reads are set up by `Guard`)."""

    # -- module hook (hot path for suspect modules and check="modules") -----------------------
    def _on_module(self, i: int, module: nn.Module, args: tuple, kwargs: dict,
                   result: Any) -> Any:
        output, rebuild = split_output(result)  # a tensor, or vLLM's (output, bias)
        if self._failed or output is None:
            return None
        try:
            st = self._state[i]
            out = output
            fb = self._fallbacks[i]
            if st != HEALTHY and fb is not None:
                x = input_of(args, kwargs)
                if x is not None:
                    alt = fb(x, output.dtype)
                    if self._in_step:  # NaN, Inf of the quantized output; non-finite inputs
                        self._counts.append((i, torch.cat([
                            nonfinite_counts(output), (~torch.isfinite(x)).sum().reshape(1)])))
                    out = alt if st == OPEN else torch.where(torch.isfinite(output), output, alt)
                    self.stats.fallback_calls += 1
            elif self._check_modules and self._in_step and not self._locating:
                x = input_of(args, kwargs)
                s_in = x.sum(dtype=torch.float32) if x is not None else output.new_zeros(())
                self._flags.append((i, torch.stack([s_in.float(), output.sum(dtype=torch.float32)])))
            if self._locating:
                out = self._locate(i, args, kwargs, output, out)
            return rebuild(out) if out is not output else None
        except Exception as exc:
            self._fail(exc)
            return None

    def _locate(self, i: int, args: tuple, kwargs: dict, raw: torch.Tensor,
                out: torch.Tensor) -> torch.Tensor:
        """Locate mode (failing steps only): check this call now; repair a producer."""
        self.stats.host_syncs += 1
        if bool(torch.isfinite(out).all()):
            return out
        x = input_of(args, kwargs)
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
        nan, inf = (int(v) for v in nonfinite_counts(raw).tolist())
        self._trip(i, nan, inf, "fallback", "producer located in the rerun of the step; "
                   "its fallback output is used from now on")
        self._state[i] = SUSPECT if self._state[i] == HEALTHY else self._state[i]
        self._breaker(i)
        alt = fb(x, raw.dtype)
        self.stats.fallback_calls += 1
        return alt if self._state[i] == OPEN else torch.where(torch.isfinite(raw), raw, alt)

    # -- step boundaries -----------------------------------------------------------------------
    def join_running_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Entered from inside `module`'s forward (`record`'s autoattach): open the step that
        the pre-hook, registered too late for this call, would have opened."""
        self._on_root_pre(module, args, kwargs)

    def _on_root_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        # One step at a time: a forward on another thread (a server's pool, a streamer's
        # generate thread) waits here until this step's post-hook (always called, also when
        # the forward raises) releases the lock. Re-entrant for nested calls of the root.
        self._step_lock.acquire()
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
            self._cache = cache_of(kwargs)
            self._cache_len = cache_length(self._cache)
            if self._cache is not None and not self._check_modules:
                why = why_not_croppable(self._cache) if not isinstance(
                    self._cache, (tuple, list)) else None
                if why:  # known before the forward: flag modules in this very step
                    self._per_module_checks(why)
        except Exception as exc:
            self._fail(exc)

    def _on_root_post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        try:
            return self._close_step(module, output)
        finally:
            try:
                self._step_lock.release()
            except RuntimeError:  # attached mid-forward: this thread never took the lock
                pass

    def _close_step(self, module: nn.Module, output: Any) -> Any:
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
        vals = fetch(tensors)
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

    def _per_module_checks(self, why: str) -> None:
        """Flag every guarded module from now on (check="modules"): with a cache that cannot
        be rolled back, the producer of a non-finite step is found at the step end instead of
        by a rerun. Said once in the log; an incident only when a step needs it."""
        if not self._check_modules:
            log.info("qforensics guard: %s; checking every guarded module from now on", why)
            self._check_modules = True
            for i in range(len(self.names)):
                self._hook(i)

    def _no_rollback(self, why: str) -> None:
        """A failed step's KV cache cannot be rolled back: say so (one incident, logged once)
        and locate producers with per-module checks instead of reruns."""
        if not self._said_no_rollback:
            self._said_no_rollback = True
            detail = f"{why}; no rerun: the guard checks every guarded module from now on"
            log.warning("qforensics guard: %s", detail)
            self._incident(KV_CACHE, "no_rollback", 0, 0, detail)
        self._per_module_checks(why)

    def _end_step(self, module: nn.Module, output: Any) -> Any:
        logits = logits_of(output)
        ok, bad_flags = self._read(logits)
        if ok and not bad_flags:
            return None
        replaced = False
        why = ""
        if self.policy.rerun:
            for attempt in range(self.policy.max_reruns):
                why = rollback(self._cache, self._cache_len) or ""
                if why:
                    self._no_rollback(why)
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
                logits = logits_of(output)
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
        if logits is None or bool(torch.isfinite(logits).all()):
            return output if replaced else None
        return self._sanitize(output, logits, why)

    def _sanitize(self, output: Any, logits: torch.Tensor, why: str) -> Any:
        nan, inf = (int(v) for v in nonfinite_counts(logits).tolist())
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
        return with_logits(output, clean)
