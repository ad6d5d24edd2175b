"""The capture session's hooks: hooks/graphstats.py's torch-op hooks on every hooked module,
which torch.compile traces into the model's graph and which an eager model runs as they are
(hooks/graphhooks.py). A mixin of the capture session (hooks/session.py), like CallHooks and
StepEnd: the step boundaries, the logits and the writer stay the session's own, and run outside
the compiled region (the root module's hooks; in vLLM the logits processor).

Before it attaches, a toy module with the same hook is traced full-graph on this torch
(graphhooks.selftest); when that fails, no layer is hooked at all (a graph break would kill
vLLM's full-graph compile), only the logits are recorded, and the trace's status says why.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from qforensics.hooks import graphhooks, graphlate, graphsnap, graphstats, statsop
from qforensics.hooks.drainer import Drainer
from qforensics.hooks.graphlate import GraphLate
from qforensics.trace import schema

if TYPE_CHECKING:
    from qforensics.hooks.snapshots import Snapshots

log = logging.getLogger("qforensics.hooks.capture")

_SELFTEST: dict[str, str | None] = {}  # device type -> None (traces) or why not
# Where compiled steps become records (QFORENSICS_DRAIN): "thread", a thread of their own
# (hooks/drainer.py); "sync", the model's thread at the step's end; "auto" (the default): the
# thread where the model runs on a GPU (its host would otherwise wait), the model's thread on
# the CPU, whose cores the drainer would take from the model (measured on 2 cores: vLLM
# compiled 1.72 with the thread against 1.53 without; HF compiled 1.34 against 1.32)
DRAIN = os.environ.get("QFORENSICS_DRAIN", "auto")
OUTSIDE_ENTRIES = 16  # entries kept for tensors recorded outside the graph
EAGER_RUNS = 2  # runs of each module a step of an eager model has entries for


def _ring_slots(ring_steps: int, lazy: bool) -> int:
    """Host slots of the ring: the steps not yet emitted, the one the op writes, one spare,
    and with lazy channel ranges the flight recorder's ring (hooks/ringranges.py)."""
    return graphlate.EMIT_BATCH + 2 + (int(ring_steps) if lazy else 0)


def is_compiled(model: nn.Module) -> bool:
    """torch.compile wraps this model (OptimizedModule) or compiled its call (Module.compile)."""
    return type(model).__name__ == "OptimizedModule" or getattr(
        model, "_compiled_call_impl", None) is not None


def selftest(device: torch.device) -> str | None:
    if device.type not in _SELFTEST:
        _SELFTEST[device.type] = graphhooks.selftest(device)
    return _SELFTEST[device.type]


class GraphMode(GraphLate):
    """Compiled mode's hooks, ring and outside-the-graph takes; the step's end and emission
    are GraphLate's (hooks/graphlate.py), the attributes it names are declared there."""

    _graph_why: str | None
    _graph_step: int
    _graph_reset = False  # Dynamo's compiled code dropped at attach (`_graph_recompile`)
    _linger_timer: "graphlate.Linger | None" = None  # the CPU's emitter once the model is quiet
    _handles: list[Any]
    _eager_model: bool
    _gemm_ids: np.ndarray
    _gemm_mask: np.ndarray  # per module id: a GEMM (`_graph_snapshot`'s outlier rule)
    _snaps: "Snapshots | None"

    def _attach_graph(self, chosen: list[tuple[str, nn.Module, str]], max_inputs: int,
                      max_outputs: int) -> int:
        """The torch-op hooks on every chosen module but the root; returns how many. The ring
        is made whatever: the logits and an adapter's takes go through the op eagerly, also
        where the hooks cannot be traced on this torch (then no layer is hooked at all: a
        graph break would kill vLLM's full-graph compile, and the status says why)."""
        skip = getattr(self, "_unhooked", set())
        mods = [(mid, m, k) for mid, (_, m, k) in enumerate(chosen)
                if k != "root" and id(m) not in skip]
        p = next(iter(chosen[-1][1].parameters()), None)
        device = p.device if p is not None and not p.is_meta else torch.device("cpu")
        why = selftest(device) if mods else None
        if why is not None:
            self._graph_why = f"compiled-mode hooks do not trace on this torch: {why}"
            log.warning("qforensics: %s; only the logits are recorded", self._graph_why)
            mods = []
        limit = int(self.options["channel_limit"])
        bounds = [graphhooks.width_bound(m, limit) for _, m, _ in mods]
        blocks = [k == "block" for _, _, k in mods]
        # channel ranges left in the ring until needed (hooks/ringranges.py): with the flight
        # recorder, which then resolves them, and a float32 trace (float16 clips as it copies)
        lazy = self._recorder is not None and self.options["channel_dtype"] != "float16"
        # + OUTSIDE_ENTRIES: what is recorded outside the graph (the logits, hooks/callhooks.py;
        # an engine's lm_head and row flags), none of it among `mods`; a model run eagerly
        # twice over: its modules may run again in a step (a guard's rerun of the layers)
        per_run = graphhooks.max_entries([m for _, m, _ in mods], blocks, max_inputs,
                                         max_outputs)
        self._gs = graphstats.GraphStats(
            entries=per_run * (EAGER_RUNS if self._eager_model else 1)
            + OUTSIDE_ENTRIES,
            tok_rows=self.adapter.token_rows(), device=device, channel_limit=limit,
            channel_io=self.options["channel_io"], snap_bytes=self.options["snapshot_budget"],
            slots=_ring_slots(self.options["ring_steps"], lazy), lazy=lazy,
            outlier=self.options["outlier_threshold"], gemm=self._gemm_ids.tolist())
        self._gemm_mask = np.zeros(len(chosen), bool)
        self._gemm_mask[self._gemm_ids] = True
        self._first_seen = statsop.NO_FIRST
        self._clean_through = -1
        if DRAIN == "thread" or (DRAIN == "auto" and device.type != "cpu"):
            batch = graphlate.EMIT_BATCH
            self._drainer = Drainer(self._graph_emit_items, batch, many=True,
                                    batch=max(1, batch // 2), linger=self._linger())
        else:  # the model's thread emits; once it goes quiet, this does
            self._linger_timer = graphlate.Linger(self, self._linger())
        # a module inside a hooked decoder block queues its tensors, which the block's hook
        # hands to the op in one call; a module outside any block calls it itself
        block_names = [chosen[mid][0] + "." for mid, _, k in mods if k == "block"]
        for (mid, m, k), bound in zip(mods, bounds):
            name = chosen[mid][0]
            inside = k != "block" and any(name.startswith(b) for b in block_names)
            hook = graphhooks.make_hook(self._gs, mid, k == "block", bound, max_inputs,
                                        max_outputs, flush=not inside)
            self._handles.append(m.register_forward_hook(hook, with_kwargs=True))
        self._graph_reset = self._graph_recompile()
        return len(mods)

    def _graph_recompile(self) -> bool:
        """A model the user compiled: drop what Dynamo compiled so far, so that its next call
        traces the hooks in (at attach) or leaves them out (at close). Dynamo does not guard on
        a module's hooks (`torch._dynamo.config.skip_nnmodule_hook_guards`): a graph compiled
        before attach would run without them, one compiled under a closed capture would go on
        writing its ring, and the next capture would reuse it. An engine (vLLM) compiles after
        attach, with its own cache: left alone. True when the compiled code was dropped."""
        if self.adapter.compiled() is not None:
            return False
        try:
            torch._dynamo.reset()
            return True
        except Exception as exc:  # noqa: BLE001 - never break the run over it
            log.warning("qforensics: torch._dynamo.reset failed (%s); a graph compiled "
                        "before capture may run without its hooks", exc)
            return False

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

    def _graph_flush(self) -> None:
        """The op call of the step's calls outside the graph (graphhooks.flush_outside)."""
        if self._gs is not None:
            graphhooks.flush_outside(self._gs)

    def _graph_snapshot(self, part: dict[str, Any] | None, step: int) -> None:
        """At the first collected step with a non-finite output, and at the first with a GEMM
        input at the outlier threshold: the call the op kept on the device (hooks/graphsnap.py)
        into the session's snapshots, as eager mode keeps them."""
        gs, snaps = self._gs, self._snaps
        if gs is None or part is None or gs.snap.done or snaps is None:
            return
        rec = part["records"]
        due = [not gs.snap.read_done[0] and bool(
            ((rec["io"] == schema.IO_OUTPUT) & (rec["nan_count"] + rec["inf_count"] > 0)).any()),
               not gs.snap.read_done[1] and bool(
            (self._gemm_mask[rec["module_id"]] & (rec["io"] == schema.IO_INPUT)
             & (rec["absmax"] >= self.options["outlier_threshold"])
             & ((rec["flags"] & schema.FLAG_NONFLOAT) == 0)).any())]
        for which, reason in enumerate(graphsnap.REASONS):
            if not due[which]:
                continue
            try:
                got = gs.snap.read(rec, step, gs.entries, which)
            except Exception as exc:  # noqa: BLE001 - never break the run over a snapshot
                log.warning("qforensics: compiled snapshot not read (%s); continuing", exc)
                gs.snap.states[which] = {"taken": False, "why": f"not read: {exc}"[:200]}
                continue
            if got is not None:
                snaps.keep_call(reason, step, *got)

    # -- the compiled step's end: no eager path, emitted late on a GPU ------------------------
    def _graph_take(self, mid: int, io: int, slot: int, t: torch.Tensor) -> bool:
        """A tensor of a call outside the compiled region (the root's logits; an engine
        adapter's takes: vLLM's lm_head, row flags) through the stats op into the ring (True;
        False: a dtype the op does not take, unrecorded and said in the status)."""
        gs = self._gs
        return gs is not None and graphhooks.record_outside(
            gs, mid, io, slot, int(self.options["channel_limit"]), t)

    def _graph_root(self, root_id: int, logits: torch.Tensor) -> bool:
        return self._graph_take(root_id, schema.IO_OUTPUT, 0, logits)

    def _graph_status(self) -> dict[str, Any]:
        st: dict[str, Any] = {"capture_mode": "compiled"}
        if self._gs is not None:
            st.update(self._gs.status())
            if self._gs.lazy and self._recorder is not None:
                # ring steps whose ranges were never copied (a later step replaced them in
                # the file's ring), and those a slot had moved past (hooks/ringranges.py)
                st["graph_ranges"] = {"lazy": True, "never_copied": self._recorder.lazy.dropped,
                                      "lost": self._gs.ranges_lost}
        d = self._drainer
        if d is not None:
            st["graph_drain"] = {"thread": True, "waits": d.waits, "spilled": d.spills,
                                 "dropped": d.dropped,
                                 **({"error": d.error} if d.error else {})}
        if self._graph_why:
            st["graph_not_recorded"] = self._graph_why
        if self._graph_reset:  # the user's model recompiled with the hooks, and after close
            st["graph_recompiled"] = True
        return st

    def _graph_close(self) -> None:
        if self._linger_timer is not None:
            self._linger_timer.close()
            self._linger_timer = None
        if self._drainer is not None:
            self._drainer.close(timeout=60)
            self._drainer = None
        if self._gs is not None:
            self._gs.close()
            if self._graph_reset:  # the hooks are gone: out of the graph too
                self._graph_recompile()
