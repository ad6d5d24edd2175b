"""The compiled step's end and its emission: what the host notes when a step the ring holds
ends (`LateStep`), and how the noted steps become records and reach the writer, several at a
time, in step order: in the model's thread, or in the drainer's (hooks/drainer.py), or a step
late where the ring is read through host copies (a GPU). A mixin of GraphMode
(hooks/graphmode.py), which attaches the traced hooks, owns the ring (hooks/graphstats.py) and
decides where emission runs (`DRAIN`).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from qforensics.hooks import graphcopy, graphstats, reduce, statsop

if TYPE_CHECKING:
    from qforensics.hooks.adapter import EngineAdapter
    from qforensics.hooks.drainer import Drainer

# emit each step one step late on the CPU too (a GPU always does): for tests of that path
LATE_ON_CPU = False
# Steps emitted together: read from the ring in one pass (GraphStats.collect_many). Without a
# drainer the model's thread emits once EMIT_BATCH steps wait; a drainer wakes once half as
# many wait (the steps go on meanwhile) and holds the ring detail of at most EMIT_BATCH
# steps: past that the oldest waiting step known finite gives it up (`_spill`), and only
# where none may, the model's thread waits. The ring holds EMIT_BATCH + 2 steps beyond what
# the flight recorder keeps in it (graphmode._ring_slots), so the op never reaches a slot
# whose detail is still to be read. Nor does a step wait
# longer than EMIT_LINGER x the writer's flush interval after it ended (an idle server's last
# steps; without a drainer, checked at the next step's end), nor at all once the op's
# first-failure word is set (`_graph_failed`: the failing step on its way to disk before
# anything else can go wrong). Close and an eager step emit what waits.
EMIT_BATCH = 8
EMIT_LINGER = 0.25


@dataclass
class LateStep:
    """What the host knows of a compiled step at its end; its records, logits figures and ids
    are read from the ring when it is emitted (`GraphLate._graph_drain`)."""

    step: int
    t0: float
    t_end: float
    first_call: int
    next_call: int
    graph_first: int
    complete: bool
    keep_channels: bool
    has_logits: bool
    logits_t: torch.Tensor | None  # on the CPU: the last logits row (a copy for the drainer)
    ids: np.ndarray | None  # None: the row and the ids come with the slot (step_extras)
    incidents: list[np.ndarray]
    kind: dict[str, Any]
    # its ring detail given up (`GraphLate._spill`): emitted from what the host noted only
    spilled: bool = False


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of a CPU tensor by numpy's one-threaded memcpy: torch's copy splits ~50k values
    over its OpenMP threads, which on a small machine may wait for a core the drainer holds
    (13 ms instead of 20 us, measured on 2 cores)."""
    t = t.contiguous()
    if not t.numel():
        return t.clone()
    return torch.from_numpy(t.reshape(-1).view(torch.uint8).numpy().copy()).view(
        t.dtype).reshape(t.shape)


def _logits_figures(row_t: torch.Tensor) -> np.ndarray:
    """The step row's logits figures, from the last logits row the host holds."""
    return reduce.logits_row(reduce.fast_logits(row_t).cpu().numpy(), row_t)


def _rows(ids: torch.Tensor | None) -> int | None:
    """The token rows of a step, from its input ids (None: not known, every row is copied)."""
    return None if ids is None else int(ids.numel())


class GraphLate:
    _gs: "graphstats.GraphStats | None"
    _late: "collections.deque[LateStep | Callable[[], None]]"
    _drainer: "Drainer | None"
    _first_seen: int  # the op's first-failure word as last read (`_graph_failed`)
    _clean_through: int  # the last step that word was clear through (-1: none yet)
    _graph_first: int
    _next_call: int
    _keep_channels: bool
    _degraded: str | None
    _logits: torch.Tensor | None
    _step_ids: torch.Tensor | None
    _step_t0: float
    _step_first_call: int
    _incidents: list[np.ndarray]
    step: int
    options: dict[str, Any]
    adapter: "EngineAdapter"
    _emit_lock: Any  # the step boundaries and `_graph_linger` (hooks/session.py)
    _in_step: bool
    _attached: bool

    if TYPE_CHECKING:  # hooks/session.py, hooks/stepend.py, hooks/graphmode.py
        def _degrade(self, exc: BaseException) -> None: ...

        def _emit_batch(self, parts: list[dict[str, Any]], *, step: int, t0: float,
                        t_end: float | None, first_call: int, next_call: int,
                        logits_row: np.ndarray | None, ids: np.ndarray, complete: bool,
                        incidents: list[np.ndarray], kind: dict[str, Any],
                        detail: bool = True) -> None: ...

        def _graph_flush(self) -> None: ...

        def _graph_snapshot(self, part: dict[str, Any] | None, step: int) -> None: ...

    def _graph_linger(self) -> None:
        """On the CPU, where no drainer thread runs (`Linger` calls this every linger period):
        the steps noted before the model went quiet (an idle server, a run stalled, or about
        to be killed) emitted once the first waited EMIT_LINGER x the flush interval, so that
        the writer's schedule puts them on disk; never during a step (`_emit_lock`: the step
        boundaries take it too)."""
        if not self._late or self._in_step:
            return
        with self._emit_lock:
            if self._in_step or self._degraded is not None or not self._attached:
                return
            first = next((i for i in self._late if isinstance(i, LateStep)), None)
            if first is None or time.time() - first.t_end < self._linger():
                return
            try:
                self._graph_drain()
            except Exception as exc:  # noqa: BLE001 - never break the run
                self._degrade(exc)

    def _graph_late(self) -> bool:
        """Emit a step at the end of the next one: a GPU, with the logits from the root (an
        engine's own tables are written at once, so its steps are too)."""
        return self._gs is not None and self.adapter.logits_from_root and (
            self._gs.device.type != "cpu" or LATE_ON_CPU)

    def _graph_end(self, complete: bool) -> None:
        """End a step the ring holds: the host notes what it knows (times, calls, incidents,
        the adapter's step kind); the last logits row and the input ids go with the step's
        slot: on a GPU the row into pinned memory and the slot's copy there start on the
        stream (one transfer each, no kernel, no sync: the logits figures are computed on the
        host when the step is emitted); on the CPU the row is kept as the step left it (an
        engine may scale it in place). Its records are built off the hot path, by the
        drainer thread (hooks/drainer.py), or without one in batches on the CPU and a step
        late on a GPU (its copy long done): no sync inside a step either way."""
        gs = self._gs
        assert gs is not None
        self._graph_flush()
        logits, ids = self._logits, self._step_ids
        row_t = ids_np = None
        if gs.copies or self._graph_late():
            gs.put_step_extras(self.step, reduce.last_logits(logits.detach())
                               if logits is not None else None, ids)
            gs.start_copy(self.step, _rows(ids))  # the slot, its outside calls included
        else:
            if logits is not None:
                row_t = reduce.last_logits(logits.detach())
                if self._drainer is not None:
                    row_t = _host_copy(row_t)
            ids_np = (ids.reshape(-1)[:graphcopy.MAX_IDS].cpu().numpy().astype(np.int64)
                      if ids is not None else np.zeros(0, np.int64))
        n = LateStep(
            self.step, self._step_t0, time.time(), self._step_first_call, self._next_call,
            self._graph_first, complete, self._keep_channels, logits is not None,
            row_t, ids_np, self._incidents, self.adapter.step_kind())
        self._incidents = []
        d = self._drainer
        if d is not None:
            if d.error is not None:
                if self._degraded is None:
                    self._degrade(RuntimeError(f"compiled steps' records: {d.error}"))
                return
            failed = self._graph_failed()
            # the drainer behind: the oldest steps known finite give up their ring detail,
            # the model's thread does not wait; never once a failure was seen
            d.put(n, spill=self._spill if self._first_seen == statsop.NO_FIRST else None)
            if failed:
                d.kick()
            return
        self._late.append(n)
        keep = 1 if self._graph_late() else 0
        waiting = [i for i in self._late if isinstance(i, LateStep)]
        if len(waiting) > keep and (
                len(waiting) >= keep + max(1, EMIT_BATCH) or self._graph_failed()
                or n.t_end - waiting[0].t_end >= self._linger()):
            self._graph_drain(keep=keep)

    def _spill(self, item: Any) -> "LateStep | None":
        """The summary form of a step waiting for the drainer (None: it keeps its detail):
        only a step the op's first-failure word was clear through (`_clean_through`), so a
        step that went bad is never spilled. It is emitted with no records (`complete` 2 in
        /steps: hooks/assemble.py), with its logits row and ids where the host holds them
        (the CPU), not where they came with its slot (a GPU)."""
        if not isinstance(item, LateStep) or item.spilled or item.step > self._clean_through:
            return None
        return dataclasses.replace(item, spilled=True)

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
        if word == statsop.NO_FIRST:  # no call failed up to the step this word is from
            self._clean_through = self.step - 1 if gs.copies else self.step
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
            if isinstance(item, LateStep) and not item.spilled:
                run.append(item)
                continue
            if run:
                self._graph_emit_many(run)
                run = []
            if isinstance(item, LateStep):
                self._graph_emit_spilled(item)
            else:
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
            row_t, ids = n.logits_t, n.ids
            if ids is None:  # its logits row and ids came with its slot
                row_t, ids = gs.step_extras(n.step)
            row = _logits_figures(row_t) if n.has_logits and row_t is not None else None
            self._emit_batch([part] if part is not None else [], step=n.step, t0=n.t0,
                             t_end=n.t_end, first_call=n.first_call, next_call=n.next_call,
                             logits_row=row, ids=ids, complete=n.complete,
                             incidents=n.incidents, kind=n.kind)

    def _graph_emit_spilled(self, n: LateStep) -> None:
        """A spilled step (`_spill`): its step row from what the host noted, no records."""
        has_row = n.has_logits and n.ids is not None and n.logits_t is not None
        row = _logits_figures(n.logits_t) if has_row else None
        self._emit_batch([], step=n.step, t0=n.t0, t_end=n.t_end, first_call=n.first_call,
                         next_call=n.next_call, logits_row=row,
                         ids=n.ids if n.ids is not None else np.zeros(0, np.int64),
                         complete=n.complete, incidents=n.incidents, kind=n.kind,
                         detail=False)


class Linger:
    """A daemon thread that asks the session every `period` seconds to emit the steps that
    waited too long (`GraphLate._graph_linger`); on the CPU, where steps are emitted in
    batches by the model's own thread and nothing else would wake up once it goes quiet."""

    def __init__(self, owner: GraphLate, period: float) -> None:
        self._owner = owner
        self._period = max(0.01, float(period))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="qforensics-linger")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            self._owner._graph_linger()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
