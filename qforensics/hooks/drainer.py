"""Compiled mode's host side off the hot path: a thread that turns the device ring's steps into
records and hands them to the writer, while the model's thread goes on with the next step.

Why a thread: on a GPU under CUDA graphs a decode step takes about 2 ms, and reading a slot of
the ring, building its records, the flight recorder's decisions and the writer's hand-off take
milliseconds of host time. Done at the step's end, in the model's thread, they hold back the
next step's launch; here they run beside it. The model's thread only notes what it knows at the
step's end (times, calls, a copy of the last logits row, the input ids, the guard's incidents)
and, on a GPU, starts the slot's asynchronous copy (hooks/graphstats.py).

- Order: items run one at a time, in the order they were put: the steps, and anything the
  engine writes between them (vLLM's own tables, `put`), reach the writer in run order.
- At most `depth` items that hold a slot of the ring wait or run at once: the ring holds as
  many steps the op has not reached again (hooks/graphmode.py sizes it so). When `depth` are
  still to run, `put` spills the oldest waiting one that its `spill` function takes (a step
  known finite: hooks/graphlate.py): that item stays in line, in a form that holds no slot (its
  summary, not its ring detail), so the op may overwrite its slot and the model's thread goes
  on. Only where nothing can be spilled (no `spill` given, the items in line all taken, or
  none that `spill` takes) does `put` wait (on the host, never on the device), so the op never
  writes a slot whose step was not yet read. Counted: `spills`, `waits`.
- Wake-ups: the thread takes the items once `batch` of them wait, or once the oldest has
  waited `linger` seconds (an idle server's last steps), or at once when `flush`, `kick` or
  `close` asks: one pass over several steps, not one a step (the issue's "every R/2 steps").
- `flush()` returns once everything put before it ran: the session calls it before a step it
  emits itself (an eager step in compiled mode), and at close.
- Batches: with `many`, the thread takes every item waiting when it wakes and hands them
  over in one call, as a list (their records are built in one pass, GraphStats.collect_many:
  its fixed cost is paid once, not once a step).
- A failure inside an item stops the drainer (later items are dropped, counted in `dropped`);
  `error` says why and the session degrades at its next step end: the run goes on.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable

log = logging.getLogger("qforensics.hooks.capture")


class _Spilled:
    """An item in line that no longer holds a ring slot (`Drainer.put`'s spill)."""

    __slots__ = ("item",)

    def __init__(self, item: Any) -> None:
        self.item = item


class Drainer:
    def __init__(self, run: Callable[[Any], None], depth: int, name: str = "qforensics-drain",
                 many: bool = False, batch: int = 1, linger: float = 0.0) -> None:
        self._run = run  # an item, or with `many` the list of the items waiting
        self._many = bool(many)
        self.depth = max(1, int(depth))  # items that may wait or run at once
        # wake once `batch` items wait, or the oldest waited `linger` s (at most the depth)
        self.batch = min(self.depth, max(1, int(batch)))
        self.linger = max(0.0, float(linger))
        self._items: collections.deque = collections.deque()
        self._since: float | None = None  # when the oldest waiting item was put
        self._urgent = False  # kick: take what waits now
        self._flushing = 0  # callers in `flush`: take what waits at once meanwhile
        self._cv = threading.Condition()
        self._busy = 0  # items taken but not finished
        self._held = 0  # items put, not finished, that hold a slot (all but spilled ones)
        self._busy_held = 0  # of the items taken, those
        self._stop = False
        self.error: str | None = None
        self.dropped = 0
        self.waits = 0  # times `put` found `depth` items behind and had to wait
        self.spills = 0  # items `put` spilled instead of waiting
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def put(self, item: Any, spill: Callable[[Any], Any] | None = None) -> None:
        """Queue an item. While `depth` items that hold a slot are still to run: the oldest
        waiting item that `spill` turns into its light form (not None) is replaced by it;
        where there is none, wait."""
        with self._cv:
            if self.error is not None or self._stop:
                self.dropped += 1
                return
            if self._held >= self.depth and not (spill is not None and self._spill(spill)):
                self.waits += 1
                # never kept waiting for a linger: `depth` waiting items are a batch, and
                # room comes when the items in hand are done
                self._cv.wait_for(lambda: self._held < self.depth or self.error is not None)
            if not self._items:
                self._since = time.monotonic()
            self._items.append(item)
            self._held += 1
            if len(self._items) in (1, self.batch):  # its linger starts; or it is due
                self._cv.notify_all()

    def _spill(self, spill: Callable[[Any], Any]) -> bool:
        """(holding the lock) Spill the oldest waiting item `spill` takes; False: none. Items
        it declines (None) and items spilled before are passed over: the first item it takes
        in line order is the oldest step."""
        for k, it in enumerate(self._items):
            if isinstance(it, _Spilled):
                continue
            light = spill(it)
            if light is not None:
                self._items[k] = _Spilled(light)
                self._held -= 1
                self.spills += 1
                return True
        return False

    def kick(self) -> None:
        """Take what waits now (a step that went bad: on disk before the next steps')."""
        with self._cv:
            self._urgent = True
            self._cv.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every item put so far has run (or the drainer failed). False on timeout."""
        if threading.current_thread() is self._thread:
            return True  # an item that flushes: everything before it ran already
        with self._cv:
            self._flushing += 1
            self._cv.notify_all()
            try:
                return self._cv.wait_for(
                    lambda: (not self._items and not self._busy) or self.error is not None,
                    timeout)
            finally:
                self._flushing -= 1

    def close(self, timeout: float | None = None) -> None:
        """Run what is queued, then end the thread."""
        self.flush(timeout)
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _ready(self) -> bool:
        """(holding the lock) Whether the thread takes the waiting items now."""
        if self._stop:
            return True
        if not self._items:
            return False
        return (self._urgent or self._flushing > 0
                or len(self._items) >= self.batch
                or time.monotonic() - self._since >= self.linger)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._ready():
                    self._cv.wait(None if not self._items else max(
                        1e-4, self._since + self.linger - time.monotonic()))
                if not self._items:
                    return  # stopped, nothing left
                self._urgent = False
                if self._many:
                    items = list(self._items)
                    self._items.clear()
                else:
                    items = [self._items.popleft()]
                    self._since = time.monotonic()  # the next one's linger, roughly
                self._busy = len(items)
                self._busy_held = sum(not isinstance(i, _Spilled) for i in items)
                items = [i.item if isinstance(i, _Spilled) else i for i in items]
            try:
                if self.error is not None:
                    self.dropped += len(items)
                else:
                    self._run(items if self._many else items[0])
            except BaseException as exc:  # noqa: BLE001 - never let the thread die silently
                self.error = f"{type(exc).__name__}: {exc}"
                log.error("qforensics: recording the compiled steps failed (%s); recording "
                          "stops, the run continues", self.error, exc_info=True)
            finally:
                with self._cv:
                    self._busy = 0
                    self._held -= self._busy_held
                    self._busy_held = 0
                    if self.error is not None:
                        self.dropped += len(self._items)
                        self._items.clear()
                        self._held = 0
                    self._cv.notify_all()
