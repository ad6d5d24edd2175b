"""The capture session in compiled mode: its per-layer hooks are hooks/graphstats.py's torch-op
hooks, which torch.compile traces into the model's graph, instead of the eager hooks of
hooks/callhooks.py. A mixin of the capture session (hooks/session.py), like CallHooks and
StepEnd: the step boundaries, the logits and the writer stay the session's own, and run outside
the compiled region (the root module's hooks; in vLLM the logits processor).

When is it on: `capture(..., compiled=True)`, a model that torch.compile wraps
(`OptimizedModule`, or a module compiled with `Module.compile()`), or an engine adapter that
says its engine compiles the model (vLLM without enforce_eager). `compiled=False` keeps the
eager hooks. Before it attaches, a toy module with the same hook is traced full-graph on this
torch (graphstats.selftest); when that fails, no layer inside the compiled region is hooked at
all (a graph break would kill vLLM's full-graph compile), only the logits are recorded, and the
trace's status says why.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from qforensics.hooks import graphstats

if TYPE_CHECKING:
    from qforensics.hooks.adapter import EngineAdapter
    from qforensics.hooks.pending import PendingStep

log = logging.getLogger("qforensics.hooks.capture")

_SELFTEST: dict[str, str | None] = {}  # device type -> None (traces) or why not


def is_compiled(model: nn.Module) -> bool:
    """torch.compile wraps this model (OptimizedModule) or compiled its call (Module.compile)."""
    return type(model).__name__ == "OptimizedModule" or getattr(
        model, "_compiled_call_impl", None) is not None


def selftest(device: torch.device) -> str | None:
    if device.type not in _SELFTEST:
        _SELFTEST[device.type] = graphstats.selftest(device)
    return _SELFTEST[device.type]


class GraphMode:
    _gs: "graphstats.GraphStats | None"
    _graph_why: str | None
    _graph_step: int
    _graph_first: int
    _next_call: int
    _pending: "PendingStep"
    _handles: list[Any]
    step: int
    options: dict[str, Any]
    adapter: "EngineAdapter"

    def _attach_graph(self, chosen: list[tuple[str, nn.Module, str]], max_inputs: int,
                      max_outputs: int) -> int:
        """The torch-op hooks on every chosen module but the root; returns how many."""
        skip = getattr(self, "_unhooked", set())
        mods = [(mid, m, k) for mid, (_, m, k) in enumerate(chosen)
                if k != "root" and id(m) not in skip]
        if not mods:
            return 0
        p = next(iter(chosen[-1][1].parameters()), None)
        device = p.device if p is not None and not p.is_meta else torch.device("cpu")
        why = selftest(device)
        if why is not None:
            self._graph_why = f"compiled-mode hooks do not trace on this torch: {why}"
            log.warning("qforensics: %s; only the logits are recorded", self._graph_why)
            return 0
        limit = int(self.options["channel_limit"])
        bounds = [graphstats.width_bound(m, limit) for _, m, _ in mods]
        blocks = [k == "block" for _, _, k in mods]
        self._gs = graphstats.GraphStats(
            entries=graphstats.max_entries(blocks, max_inputs, max_outputs),
            tok_rows=self.adapter.token_rows(), device=device, channel_limit=limit,
            channel_io=self.options["channel_io"])
        for (mid, m, k), bound in zip(mods, bounds):
            hook = graphstats.make_hook(self._gs, mid, k == "block", bound, max_inputs,
                                        max_outputs)
            self._handles.append(m.register_forward_hook(hook, with_kwargs=True))
        return len(mods)

    def _graph_rows(self) -> int | None:
        """Token rows of the open step (its input ids), when known: token maxima are read
        that far."""
        ids = getattr(self, "_step_ids", None)
        return int(ids.numel()) if isinstance(ids, torch.Tensor) and ids.numel() else None

    def _graph_begin(self) -> None:
        if self._gs is not None:
            self._gs.begin(self.step)

    def _graph_reserve(self) -> None:
        """When the forward returns (before the logits' call): the call indices of this step's
        compiled calls, and on a GPU the start of the buffers' copy to the host."""
        gs = self._gs
        if gs is None or self._graph_step == self.step:
            return
        self._graph_step = self.step
        self._graph_first = self._next_call
        self._next_call += len(gs.call_order())
        gs.start_copy(self._graph_rows())

    def _graph_part(self) -> dict[str, Any] | None:
        """This step's records from the static buffers (assemble.assemble_records' layout)."""
        if self._gs is None:
            return None
        self._graph_reserve()
        return self._gs.collect(self.step, self._graph_first, bool(self._pending.keep))

    def _graph_status(self) -> dict[str, Any]:
        st: dict[str, Any] = {"capture_mode": "compiled" if self._gs is not None or
                              self._graph_why else "eager"}
        if self._gs is not None:
            st.update(self._gs.status())
            st["snapshots_compiled"] = "not taken inside compiled regions"
        if self._graph_why:
            st["graph_not_recorded"] = self._graph_why
        return st

    def _graph_close(self) -> None:
        if self._gs is not None:
            self._gs.close()
