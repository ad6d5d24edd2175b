"""The capture session's root hooks: the model's forward pre-hook and post-hook, which open and
close a step and hand the logits to the stats op (hooks/graphmode.py `_graph_root`). The hooked
modules' hooks are the stats op's (hooks/graphhooks.py), eager or traced. A mixin of the
capture session (hooks/session.py), like StepEnd: it reads and writes the session's step state
(`_next_call`, `_in_step`, `_root_depth`, `_logits`) and calls its step boundaries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn


if TYPE_CHECKING:
    from qforensics.hooks.adapter import EngineAdapter

HIDDEN_KWARGS = ("hidden_states", "input", "x", "inputs_embeds")
MAX_INPUTS = 4
MAX_OUTPUTS = 2


def _first_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, dict):  # ModelOutput is a dict subclass
        v = obj.get("logits")
        if isinstance(v, torch.Tensor):
            return v
        for v in obj.values():
            if isinstance(v, torch.Tensor):
                return v
    if isinstance(obj, (tuple, list)):
        for v in obj:
            if isinstance(v, torch.Tensor):
                return v
    return None



class CallHooks:
    _degraded: str | None
    _in_step: bool
    _root_depth: int
    _next_call: int
    _logits: torch.Tensor | None
    _step_lock: Any
    adapter: "EngineAdapter"

    if TYPE_CHECKING:  # provided by the session (hooks/session.py) and StepEnd
        def _begin_step(self, ids: torch.Tensor | None) -> None: ...
        def _end_step(self, complete: bool) -> None: ...
        def _degrade(self, exc: BaseException) -> None: ...
        def _graph_reserve(self) -> None: ...
        def _graph_root(self, root_id: int, logits: torch.Tensor) -> bool: ...

    def join_running_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Attached from inside `module`'s forward (`record`'s autoattach): open the step that
        the pre-hook, registered too late for this call, would have opened."""
        self._on_root_pre(module, args, kwargs)

    # -- the hooks (hot path) ----------------------------------------------------------------
    def _on_root_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        # One step at a time across threads: released by _on_root_post (always called).
        self._step_lock.acquire()
        if self._degraded:
            return
        try:
            self._root_depth += 1
            if self._root_depth > 1:
                return  # re-entrant call of the root: same step
            if self._in_step:  # calls arrived before this forward: close that implicit step
                self._end_step(complete=True)
            ids = kwargs.get("input_ids")
            if not isinstance(ids, torch.Tensor):
                ids = next((a for a in args if isinstance(a, torch.Tensor)), None)
            self._begin_step(ids if isinstance(ids, torch.Tensor) and not ids.is_floating_point()
                             else None)
            self.adapter.step_began(self, args, kwargs)  # type: ignore[arg-type]
        except Exception as exc:
            self._degrade(exc)

    def _on_root_post(self, root_id: int, module: nn.Module, args: tuple, kwargs: dict,
                      output: Any) -> None:
        try:
            self._close_root(root_id, output)
        finally:
            try:
                self._step_lock.release()
            except RuntimeError:  # attached mid-forward: this thread never took the lock
                pass

    def _close_root(self, root_id: int, output: Any) -> None:
        if self._degraded:
            return
        try:
            self._root_depth = max(0, self._root_depth - 1)
            if self._root_depth > 0:
                return
            if not self.adapter.logits_from_root:  # the adapter ends the step (its logits)
                if self._in_step:
                    self._graph_reserve()  # compiled mode: the layers' calls, before the logits'
                    self.adapter.root_returned(self, output)  # type: ignore[arg-type]
                return
            if not self._in_step:
                self._begin_step(None)
            self._graph_reserve()  # compiled mode: the layers' calls came before the logits
            logits = _first_tensor(output)
            if logits is not None:
                # through the stats op into the ring (a dtype it does not take: unrecorded,
                # the status says so)
                self._graph_root(root_id, logits)
                self._next_call += 1
                if logits.is_floating_point() and logits.numel() and not logits.is_meta:
                    self._logits = logits
            self._end_step(complete=output is not None)
        except Exception as exc:
            self._degrade(exc)
