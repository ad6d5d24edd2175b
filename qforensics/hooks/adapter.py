"""The capture core's one seam to an engine: `EngineAdapter`, and the calls an adapter may make
on the session (`AdapterCalls`).

The core (hooks/session.py) knows modules, calls and steps: a step opens when the model's
forward starts and, for a plain model (HF transformers), closes when it returns the logits. An
engine gives these words another meaning, and an adapter (engines/) says which:
- whether the engine compiles the model (compiled mode's graph hooks, never forwards folded
  into modules that torch.compile traces) and how many token rows a step may have;
- modules it records itself instead of through a hook (vLLM's lm_head, which its logits
  processor applies without calling the module's forward);
- what a step is: its requests, positions, phases and warm-up flag (`step_began`), and where it
  ends when the forward does not return the logits (`logits_from_root` False: the adapter
  hooks what produces them and calls `end_step`);
- what the flight recorder should know of the step (`step_kind`: prefill, warm-up).

An adapter touches the session only through `AdapterCalls`, never through its private state.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
from torch import nn

from qforensics.trace import schema
from qforensics.trace.writer import StepBatch

ModuleRow = tuple[str, nn.Module, str]  # (name, module, kind), as hooks/modules.py selects


class EngineAdapter:
    """A plain model: one root forward is one step, and the root returns the logits. Engine
    adapters subclass it and override what differs."""

    logits_from_root = True  # False: the adapter ends each step (`AdapterCalls.end_step`)

    def compiled(self) -> bool | None:
        """True when the engine compiles the model; None: the core looks at the model."""
        return None

    def token_rows(self) -> int:
        """Token rows a step may have at most (compiled mode sizes its buffers by it)."""
        return 8192

    def extra_modules(self, model: nn.Module, chosen: list[ModuleRow]) -> list[ModuleRow]:
        """Modules this adapter records itself (no hook): listed in the trace like the hooked
        ones, with their parameter evidence."""
        return []

    def attach(self, session: "AdapterCalls") -> None:
        """Once the core's hooks are on: add the adapter's own (`session.hook_output`)."""

    def step_began(self, session: "AdapterCalls", args: tuple, kwargs: dict) -> None:
        """A new step opened (the root forward's arguments): write its engine rows."""

    def root_returned(self, session: "AdapterCalls", output: Any) -> None:
        """The root forward returned, and `logits_from_root` is False: the step goes on."""

    def step_kind(self) -> dict[str, Any]:
        """What the flight recorder should know of the open step (prefill, warmup)."""
        return {}


def engine_batch(**tables: np.ndarray) -> StepBatch:
    """A batch holding only /engine rows (the non-empty tables given)."""
    return StepBatch(
        steps=np.zeros(0, schema.step_dtype()), records=np.zeros(0, schema.record_dtype()),
        chan_min=np.zeros(0), chan_max=np.zeros(0), tok_absmax=np.zeros(0, np.float32),
        input_ids=np.zeros(0, np.int64), engine={k: v for k, v in tables.items() if len(v)})


class AdapterCalls:
    """What an adapter may ask of the capture session (a mixin of hooks/session.py's Capture)."""

    step: int
    _degraded: str | None
    _in_step: bool
    _next_call: int
    _logits: torch.Tensor | None
    _modules: list[nn.Module]
    _handles: list[Any]
    _writer: Any

    if TYPE_CHECKING:
        def _end_step(self, complete: bool) -> None: ...
        def _degrade(self, exc: BaseException) -> None: ...
        def _graph_take(self, mid: int, io: int, slot: int, t: torch.Tensor) -> bool: ...
        def _graph_defer(self, fn: Callable[[], None]) -> None: ...

    @property
    def recording(self) -> bool:
        """False once capture degraded (an internal error): adapters stop recording too."""
        return self._degraded is None

    @property
    def in_step(self) -> bool:
        return self._in_step

    @property
    def root_id(self) -> int:
        return len(self._modules) - 1

    def module_id(self, module: nn.Module) -> int | None:
        """The trace's module id of `module` (None: not captured, or the root)."""
        return next((i for i, m in enumerate(self._modules[:-1]) if m is module), None)

    def hook_output(self, module: nn.Module, fn: Callable[[nn.Module, tuple, Any], None]
                    ) -> None:
        """A forward hook on `module`, removed when the capture closes."""
        self._handles.append(module.register_forward_hook(fn, always_call=True))

    def new_call(self) -> int:
        """The next call index (execution order across the run)."""
        ci = self._next_call
        self._next_call = ci + 1
        return ci

    def take(self, call: int, module_id: int, io: int, slot: int, tensor: torch.Tensor) -> None:
        """Record `tensor` as input or output (`io`) `slot` of `call` of `module_id` (no sync):
        through the stats op into the ring (hooks/graphmode.py); the op places the calls
        outside the graph after the step's others, in the order they come (`call` keeps the
        run's call count)."""
        self._graph_take(module_id, io, slot, tensor)

    def set_logits(self, logits: torch.Tensor) -> None:
        """The step's logits, for its summary (the root's output when the adapter records it)."""
        if logits.is_floating_point() and logits.numel():
            self._logits = logits

    def end_step(self, complete: bool = True) -> None:
        self._end_step(complete=complete)

    def submit_engine(self, **tables: np.ndarray) -> None:
        """Rows of the trace's /engine tables (steps, rows, requests, sampled)."""
        if self._writer is None:
            return
        # after the compiled steps not emitted yet (hooks/graphmode.py)
        self._graph_defer(partial(self._writer.submit, engine_batch(**tables)))

    def degrade(self, exc: BaseException) -> None:
        """Stop recording after an internal error (logged once); the run goes on."""
        self._degrade(exc)
