"""A compiled step's channel ranges left in the stats op's ring until a batch needs them.

Why: the per-channel minima and maxima are most of a step's bytes (~2.7 MB for SmolLM2 in HF,
~4 MB in vLLM), and the flight recorder sends most steps to the file's ring of the last
`ring_steps` steps, where a later step of the same slot replaces them: on a GPU at ~2 ms a step
the writer, which writes about once a second, keeps 16 of ~500. Copying every step's ranges
out of the ring at its end (graphstats.collect) cost the host ~1 ms a step for nothing.

So in compiled mode a step's batch carries its ranges as two `LazyHalf` objects (`len` is
their count; numpy reads them through `__array__`) over one `SlotRanges`: the step's slot of the
device ring (or its pinned copy on a GPU) and where each entry's span lies. They are copied out
once, by the first of:
- the flight recorder, for a step it keeps (a prefill, a trigger's window: `materialize`);
- the writer, for a step whose ring slot it writes (trace/batch.resolve_channels);
- the recorder again, `ring_steps + 1` steps later at the latest (`LazyTracker.advance`): by
  then the op may soon reuse the slot. A step that a later ring step of the same file slot has
  replaced by then is dropped, never copied: the writer would not write it.
The ring has ring_steps + EMIT_BATCH + 2 slots (hooks/graphmode.py `_ring_slots`; on a GPU,
its pinned host copies, one per step), so that a step is still there however far emission lags
(the model's thread waits at EMIT_BATCH steps not yet emitted). A read checks the entries'
stamps before and after the copy; a slot that moved on reads None (`lost`), said in the
status, never as data.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import numpy as np

from qforensics.trace.batch import resolve_channels


class SlotRanges:
    """One step's channel ranges in its ring slot, copied out at most once (thread-safe: the
    writer's thread and the recorder's may both ask)."""

    __slots__ = ("gs", "step", "spans", "n", "_got", "_state", "_lock")

    def __init__(self, gs: Any, step: int, spans: dict[str, Any]) -> None:
        # gs: the GraphStats whose ring holds the step (its `read_ranges`, `ranges_lost`)
        self.gs, self.step, self.spans = gs, int(step), spans
        self.n = int(spans["total"])
        self._got: tuple[np.ndarray, np.ndarray] | None = None
        self._state = "lazy"  # lazy, read, dropped, lost
        self._lock = threading.Lock()

    def halves(self) -> tuple["LazyHalf", "LazyHalf"]:
        return LazyHalf(self, 0), LazyHalf(self, 1)

    def get(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The minima and maxima (copied now if not yet), None when they are gone."""
        with self._lock:
            if self._state == "lazy":
                self._got = self.gs.read_ranges(self.step, self.spans)
                self._state = "read" if self._got is not None else "lost"
                if self._got is None:
                    self.gs.ranges_lost += 1
            return self._got

    def drop(self) -> None:
        """Never needed (a later step replaced it in the file's ring): not copied."""
        with self._lock:
            if self._state == "lazy":
                self._state = "dropped"

    @property
    def pending(self) -> bool:
        return self._state == "lazy"


class LazyHalf:
    """The minima (0) or maxima (1) of a `SlotRanges`, where a batch holds an array."""

    __slots__ = ("src", "which")

    def __init__(self, src: SlotRanges, which: int) -> None:
        self.src, self.which = src, which

    def __len__(self) -> int:
        return self.src.n

    def resolve(self) -> tuple[np.ndarray, np.ndarray] | None:
        return self.src.get()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        got = self.src.get()
        if got is None:
            raise LookupError(f"the channel ranges of step {self.src.step} left the ring "
                              f"({self.src._state})")
        a = got[self.which]
        return a if dtype is None else a.astype(dtype, copy=False)


def materialize(batch: Any) -> bool:
    """Replace a batch's lazy ranges by arrays; False when they are gone (the batch then holds
    none, and its records no channel offsets)."""
    if resolve_channels(batch):
        return True
    batch.records["chan_offset"] = -1
    return False


class LazyTracker:
    """The flight recorder's view of the ring steps whose ranges are still lazy: each is
    copied out or dropped `horizon` steps after its own, before the op reuses its slot."""

    def __init__(self, horizon: int, file_slots: int) -> None:
        self.horizon = max(1, int(horizon))
        self.file_slots = max(1, int(file_slots))
        self._lazy: collections.deque = collections.deque()  # (step, SlotRanges)
        self._last_ring: dict[int, int] = {}  # file slot -> its latest ring step
        self.dropped = 0

    def note_ring(self, step: int, ranges: Any) -> None:
        """A step gone to the file's ring, its ranges lazy or not."""
        self._last_ring[step % self.file_slots] = step
        src = getattr(ranges, "src", None)
        if isinstance(src, SlotRanges) and src.pending:
            self._lazy.append((step, src))

    def advance(self, step: int) -> None:
        """At `step`: resolve every lazy step `horizon` or more behind it."""
        q = self._lazy
        while q and q[0][0] <= step - self.horizon:
            s, src = q.popleft()
            if not src.pending:
                continue
            if self._last_ring.get(s % self.file_slots, s) > s:
                src.drop()  # a later ring step holds its file slot: never written
                self.dropped += 1
            else:
                src.get()
