"""The capture session in compiled mode: its per-layer hooks are hooks/graphstats.py's torch-op
hooks, which torch.compile traces into the model's graph, instead of the eager hooks of
hooks/callhooks.py. A mixin of the capture session (hooks/session.py), like CallHooks and
StepEnd: the step boundaries, the logits and the writer stay the session's own, and run outside
the compiled region (the root module's hooks; in vLLM the logits processor).

When is it on: `capture(..., compiled=True)`, a model that torch.compile wraps
(`OptimizedModule`, or a module compiled with `Module.compile()`), or an engine adapter that
says its engine compiles the model (vLLM without enforce_eager). `compiled=False` keeps the
eager hooks. Before it attaches, a toy module with the same hook is traced full-graph on this
torch (graphhooks.selftest); when that fails, no layer inside the compiled region is hooked at
all (a graph break would kill vLLM's full-graph compile), only the logits are recorded, and the
trace's status says why.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
from torch import nn

from qforensics.hooks import graphhooks, graphstats, reduce, statsop
from qforensics.hooks.drainer import Drainer
from qforensics.trace import schema

if TYPE_CHECKING:
    from qforensics.hooks.adapter import EngineAdapter
    from qforensics.hooks.pending import PendingStep
    from qforensics.hooks.snapshots import Snapshots

log = logging.getLogger("qforensics.hooks.capture")

_SELFTEST: dict[str, str | None] = {}  # device type -> None (traces) or why not
# emit each step one step late on the CPU too (a GPU always does): for tests of that path
LATE_ON_CPU = False
# Where compiled steps become records (QFORENSICS_DRAIN): "thread", a thread of their own
# (hooks/drainer.py); "sync", the model's thread at the step's end; "auto" (the default): the
# thread where the model runs on a GPU (its host would otherwise wait), the model's thread on
# the CPU, whose cores the drainer would take from the model (measured on 2 cores: vLLM
# compiled 1.72 with the thread against 1.53 without; HF compiled 1.34 against 1.32)
DRAIN = os.environ.get("QFORENSICS_DRAIN", "auto")
OUTSIDE_ENTRIES = 16  # entries kept for tensors recorded outside the graph
# Steps emitted together: read from the ring in one pass (GraphStats.collect_many, whose cost is
# mostly numpy's fixed cost per call, paid once for all of them). Without a drainer the model's
# thread emits once EMIT_BATCH steps wait; a drainer wakes once half as many wait (the steps
# go on meanwhile), and lets the model's thread run at most EMIT_BATCH steps ahead. The ring
# holds EMIT_BATCH + 2 steps beyond what the flight recorder keeps in it (`_ring_slots`), so
# the op never reaches a slot not yet read. Nor does a step wait longer than EMIT_LINGER x the
# writer's flush interval after it ended (an idle server's last steps; without a drainer, checked
# at the next step's end), nor at all on the CPU once the op's first-failure word is set (the
# failing step on its way to disk before anything else can go wrong). Close and an eager step
# emit what waits.
EMIT_BATCH = 8
EMIT_LINGER = 0.25


def _ring_slots(ring_steps: int, lazy: bool) -> int:
    """Host slots of the ring: the steps not yet emitted, the one the op writes, one spare,
    and with lazy channel ranges the flight recorder's ring (hooks/ringranges.py)."""
    return EMIT_BATCH + 2 + (int(ring_steps) if lazy else 0)


@dataclass
class LateStep:
    """What the host knows of a compiled step at its end; its records, logits figures and ids
    are read from the ring when it is emitted (`GraphMode._graph_drain`)."""

    step: int
    t0: float
    t_end: float
    first_call: int
    next_call: int
    graph_first: int
    complete: bool
    keep_channels: bool
    has_logits: bool
    logits_row: np.ndarray | None  # already known
    logits_t: torch.Tensor | None  # on the CPU: the last logits row (a copy for the drainer)
    ids: np.ndarray | None
    incidents: list[np.ndarray]
    kind: dict[str, Any]


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of a CPU tensor by numpy's one-threaded memcpy: torch's copy splits ~50k values
    over its OpenMP threads, which on a small machine may wait for a core the drainer holds
    (13 ms instead of 20 us, measured on 2 cores)."""
    t = t.contiguous()
    if not t.numel():
        return t.clone()
    return torch.from_numpy(t.reshape(-1).view(torch.uint8).numpy().copy()).view(
        t.dtype).reshape(t.shape)


def _rows(ids: torch.Tensor | None) -> int | None:
    """The token rows of a step, from its input ids (None: not known, every row is copied)."""
    return None if ids is None else int(ids.numel())


def is_compiled(model: nn.Module) -> bool:
    """torch.compile wraps this model (OptimizedModule) or compiled its call (Module.compile)."""
    return type(model).__name__ == "OptimizedModule" or getattr(
        model, "_compiled_call_impl", None) is not None


def selftest(device: torch.device) -> str | None:
    if device.type not in _SELFTEST:
        _SELFTEST[device.type] = graphhooks.selftest(device)
    return _SELFTEST[device.type]


class GraphMode:
    _gs: "graphstats.GraphStats | None"
    _graph_why: str | None
    _graph_step: int
    _graph_first: int
    _next_call: int
    _pending: "PendingStep"
    _handles: list[Any]
    _late: "collections.deque[LateStep | Callable[[], None]]"
    _drainer: Drainer | None
    _graph_lane: int
    _degraded: str | None
    _logits: torch.Tensor | None
    _step_ids: torch.Tensor | None
    _step_t0: float
    _step_first_call: int
    _incidents: list[np.ndarray]
    _snaps: "Snapshots | None"
    step: int
    options: dict[str, Any]
    adapter: "EngineAdapter"

    if TYPE_CHECKING:  # hooks/session.py, hooks/stepend.py
        def _degrade(self, exc: BaseException) -> None: ...

        def _emit_batch(self, parts: list[dict[str, Any]], *, step: int, t0: float,
                        t_end: float | None, first_call: int, next_call: int,
                        logits_row: np.ndarray | None, ids: np.ndarray, complete: bool,
                        incidents: list[np.ndarray], kind: dict[str, Any]) -> None: ...

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
        bounds = [graphhooks.width_bound(m, limit) for _, m, _ in mods]
        blocks = [k == "block" for _, _, k in mods]
        # channel ranges left in the ring until needed (hooks/ringranges.py): with the flight
        # recorder, which then resolves them, and a float32 trace (float16 clips as it copies)
        lazy = self._recorder is not None and self.options["channel_dtype"] != "float16"
        # + OUTSIDE_ENTRIES: what is recorded outside the graph (the logits, hooks/callhooks.py;
        # an engine's lm_head and row flags), none of it among `mods`
        self._gs = graphstats.GraphStats(
            entries=graphhooks.max_entries([m for _, m, _ in mods], blocks, max_inputs,
                                           max_outputs) + OUTSIDE_ENTRIES,
            tok_rows=self.adapter.token_rows(), device=device, channel_limit=limit,
            channel_io=self.options["channel_io"], snap_bytes=self.options["snapshot_budget"],
            slots=_ring_slots(self.options["ring_steps"], lazy), lazy=lazy)
        self._first_seen = statsop.NO_FIRST
        if DRAIN == "thread" or (DRAIN == "auto" and device.type != "cpu"):
            self._drainer = Drainer(self._graph_emit_items, EMIT_BATCH, many=True,
                                    batch=max(1, EMIT_BATCH // 2), linger=self._linger())
        # a module inside a hooked decoder block queues its tensors, which the block's hook
        # hands to the op in one call; a module outside any block calls it itself
        block_names = [chosen[mid][0] + "." for mid, _, k in mods if k == "block"]
        for (mid, m, k), bound in zip(mods, bounds):
            name = chosen[mid][0]
            inside = k != "block" and any(name.startswith(b) for b in block_names)
            hook = graphhooks.make_hook(self._gs, mid, k == "block", bound, max_inputs,
                                        max_outputs, flush=not inside)
            self._handles.append(m.register_forward_hook(hook, with_kwargs=True))
        return len(mods)

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

    def _graph_part(self) -> dict[str, Any] | None:
        """This step's records from the static buffers (assemble.assemble_records' layout)."""
        if self._gs is None:
            return None
        self._graph_flush()
        self._graph_reserve()
        part = self._gs.collect(self.step, self._graph_first, bool(self._pending.keep))
        self._graph_snapshot(part, self.step)
        return part

    def _graph_snapshot(self, part: dict[str, Any] | None, step: int) -> None:
        """At the first collected step with a non-finite output: the call the op kept on the
        device (hooks/graphsnap.py) into the session's snapshots, as eager mode keeps it."""
        gs, snaps = self._gs, self._snaps
        if gs is None or part is None or gs.snap.done or snaps is None:
            return
        rec = part["records"]
        if not ((rec["io"] == schema.IO_OUTPUT) & (rec["nan_count"] + rec["inf_count"] > 0)
                ).any():
            return
        try:
            got = gs.snap.read(rec, step, gs.entries)
        except Exception as exc:  # noqa: BLE001 - never break the run over a snapshot
            log.warning("qforensics: compiled snapshot not read (%s); continuing", exc)
            gs.snap.state = {"taken": False, "why": f"not read: {exc}"[:200]}
            return
        if got is not None:
            if "first_nonfinite_output" in snaps.snapped:  # an eager part of a step kept one
                gs.snap.state = {"taken": False, "why": "kept by the eager path"}
            else:
                snaps.keep_call("first_nonfinite_output", step, *got)

    # -- the compiled step's end: no eager path, emitted late on a GPU ------------------------
    def _graph_take(self, mid: int, io: int, slot: int, t: torch.Tensor) -> bool:
        """A tensor of a call outside the compiled region (the root's logits; an engine
        adapter's takes: vLLM's lm_head, row flags) through the stats op into the ring (True),
        in compiled mode while nothing of the step went the eager way."""
        gs = self._gs
        if gs is None or len(self._pending) or not graphhooks.record_outside(
                gs, mid, io, slot, int(self.options["channel_limit"]), t):
            return False
        self._graph_lane = self.step  # this step's outside calls went to the ring
        return True

    def _graph_root(self, root_id: int, logits: torch.Tensor) -> bool:
        return self._graph_take(root_id, schema.IO_OUTPUT, 0, logits)

    def _graph_owns_step(self) -> bool:
        """The step's records are all in the ring (`_graph_take` took what it had outside
        the graph) and nothing eager is pending."""
        return (self._gs is not None and self._graph_lane == self.step
                and not len(self._pending))

    def _graph_late(self) -> bool:
        """Emit a step at the end of the next one: a GPU, with the logits from the root (an
        engine's own tables are written at once, so its steps are too)."""
        return self._gs is not None and self.adapter.logits_from_root and (
            self._gs.device.type != "cpu" or LATE_ON_CPU)

    def _graph_end(self, complete: bool) -> None:
        """End a step the ring holds: the host notes what it knows (times, calls, incidents,
        the adapter's step kind, a copy of the last logits row on the CPU); on a GPU the
        logits figures and ids go into the step's slot on the device and the slot's copy to
        pinned memory starts. Its records are built off the hot path, by the drainer thread
        (hooks/drainer.py), or without one at once on the CPU and a step late on a GPU (its
        copy long done): no sync inside a step either way."""
        gs = self._gs
        assert gs is not None
        self._graph_flush()
        logits, ids = self._logits, self._step_ids
        row = row_t = ids_np = None
        if self._graph_late():
            gs.put_step_extras(self.step, reduce.exact_logits(logits)
                               if logits is not None else None, ids)
            gs.start_copy(self.step, _rows(ids))  # the slot, its outside calls included
        else:
            if logits is not None and logits.device.type == "cpu":
                # reduced when the step is emitted: at once without a drainer, else later,
                # from a copy as the step left it (an engine may scale it in place)
                row_t = reduce.last_logits(logits.detach())
                if self._drainer is not None:
                    row_t = _host_copy(row_t)
            elif logits is not None:  # an engine's logits on a GPU: read now, as before
                row = reduce.logits_row(reduce.fast_logits(logits).cpu().numpy(), logits)
            ids_np = (ids.reshape(-1)[:graphstats.MAX_IDS].cpu().numpy().astype(np.int64)
                      if ids is not None else np.zeros(0, np.int64))
            if gs.copies:  # on this thread's stream, after the step's kernels
                gs.start_copy(self.step, _rows(ids))
        n = LateStep(
            self.step, self._step_t0, time.time(), self._step_first_call, self._next_call,
            self._graph_first, complete, bool(self._pending.keep), logits is not None, row,
            row_t, ids_np, self._incidents, self.adapter.step_kind())
        self._incidents = []
        d = self._drainer
        if d is not None:
            if d.error is not None:
                if self._degraded is None:
                    self._degrade(RuntimeError(f"compiled steps' records: {d.error}"))
                return
            d.put(n)
            if self._graph_failed():
                d.kick()
            return
        self._late.append(n)
        keep = 1 if self._graph_late() else 0
        waiting = [i for i in self._late if isinstance(i, LateStep)]
        if len(waiting) > keep and (
                len(waiting) >= keep + max(1, EMIT_BATCH) or self._graph_failed()
                or n.t_end - waiting[0].t_end >= self._linger()):
            self._graph_drain(keep=keep)

    def _linger(self) -> float:
        """The longest a step waits to be emitted, in seconds (EMIT_LINGER)."""
        return EMIT_LINGER * float(self.options["flush_interval"])

    def _graph_failed(self) -> bool:
        """The op's first-failure word changed since the last look: on the CPU read in place
        (host memory); where the ring is read through host copies (a GPU), from the copy of
        the step before this one, if it is done (never a sync: the failing step is noticed a
        step late)."""
        gs = self._gs
        if gs is None:
            return False
        if gs.copies:
            got = gs.copied_first(self.step - 1)
            if got is None:
                return False
            word = got
        else:
            word = int(gs.first_word[0])
        if word == self._first_seen:
            return False
        self._first_seen = word
        return True

    def _graph_defer(self, fn: "Callable[[], None]") -> None:
        """Run `fn` (an engine's write between steps) after the steps noted before it: on the
        drainer, after the steps waiting on the model's thread, or now."""
        if self._drainer is not None:
            self._drainer.put(fn)
        elif self._late:
            self._late.append(fn)
        else:
            fn()

    def _graph_drain(self, keep: int = 0) -> None:
        """Emit the noted steps (and the writes queued between them) but the last `keep`
        steps, oldest first, together; with a drainer, wait until it has emitted everything put
        so far."""
        d = self._drainer
        if d is not None:
            d.flush()
            if d.error is not None and self._degraded is None:
                self._degrade(RuntimeError(f"compiled steps' records: {d.error}"))
        late, gs = self._late, self._gs
        if gs is None:
            return
        n = sum(isinstance(i, LateStep) for i in late) - keep
        items = []
        while late and n > 0:
            items.append(late.popleft())
            n -= isinstance(items[-1], LateStep)
        while late and not isinstance(late[0], LateStep):  # writes after the last step emitted
            items.append(late.popleft())
        self._graph_emit_items(items)

    def _graph_emit_items(self, items: "list[LateStep | Callable[[], None]]") -> None:
        """Noted steps and the writes between them, in order: each run of consecutive steps
        read from the ring in one pass."""
        run: list[LateStep] = []
        for item in items:
            if isinstance(item, LateStep):
                run.append(item)
                continue
            if run:
                self._graph_emit_many(run)
                run = []
            item()
        if run:
            self._graph_emit_many(run)

    def _graph_emit_many(self, ns: list[LateStep]) -> None:
        """Noted steps' records from their slots of the ring, to the writer, oldest first."""
        gs = self._gs
        assert gs is not None
        try:
            parts = gs.collect_many([(n.step, n.graph_first, n.keep_channels) for n in ns])
        except Exception:
            if len(ns) == 1:
                raise
            for n in ns:  # one by one: the steps before the one that fails are kept
                self._graph_emit_many([n])
            return
        for n, part in zip(ns, parts):
            self._graph_snapshot(part, n.step)
            row, ids = n.logits_row, n.ids
            if n.logits_t is not None:
                row = reduce.logits_row(reduce.fast_logits(n.logits_t).cpu().numpy(),
                                        n.logits_t)
            if ids is None:  # a late step: its figures and ids come with its slot
                figs, ids = gs.step_extras(n.step)
                row = figs if n.has_logits else None
            self._emit_batch([part] if part is not None else [], step=n.step, t0=n.t0,
                             t_end=n.t_end, first_call=n.first_call, next_call=n.next_call,
                             logits_row=row, ids=ids, complete=n.complete,
                             incidents=n.incidents, kind=n.kind)

    def _graph_status(self) -> dict[str, Any]:
        st: dict[str, Any] = {"capture_mode": "compiled" if self._gs is not None or
                              self._graph_why else "eager"}
        if self._gs is not None:
            st.update(self._gs.status())
            if self._gs.lazy and self._recorder is not None:
                # ring steps whose ranges were never copied (a later step replaced them in
                # the file's ring), and those a slot had moved past (hooks/ringranges.py)
                st["graph_ranges"] = {"lazy": True, "never_copied": self._recorder.lazy.dropped,
                                      "lost": self._gs.ranges_lost}
        d = self._drainer
        if d is not None:
            st["graph_drain"] = {"thread": True, "waits": d.waits, "dropped": d.dropped,
                                 **({"error": d.error} if d.error else {})}
        if self._graph_why:
            st["graph_not_recorded"] = self._graph_why
        return st

    def _graph_close(self) -> None:
        if self._drainer is not None:
            self._drainer.close(timeout=60)
            self._drainer = None
        if self._gs is not None:
            self._gs.close()
