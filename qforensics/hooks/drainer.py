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
- At most `depth` items wait or run at once: the ring holds as many steps the op has not
  reached again (hooks/graphmode.py sizes it so). `put` waits (on the host, never on the
  device) while `depth` items are still to run, so the op never writes a slot whose step was
  not yet read: no step is lost, the model's thread waits instead.
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
        self._stop = False
        self.error: str | None = None
        self.dropped = 0
        self.waits = 0  # times `put` found the drainer `depth` items behind
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def put(self, item: Any) -> None:
        """Queue an item; waits while `depth` items are still to run."""
        with self._cv:
            if self.error is not None or self._stop:
                self.dropped += 1
                return
            if len(self._items) + self._busy >= self.depth:
                self.waits += 1
                # never kept waiting for a linger: `depth` waiting items are a batch, and
                # room comes when the items in hand are done
                self._cv.wait_for(lambda: len(self._items) + self._busy < self.depth
                                  or self.error is not None)
            if not self._items:
                self._since = time.monotonic()
            self._items.append(item)
            if len(self._items) in (1, self.batch):  # its linger starts; or it is due
                self._cv.notify_all()

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
                    if self.error is not None:
                        self.dropped += len(self._items)
                        self._items.clear()
                    self._cv.notify_all()
