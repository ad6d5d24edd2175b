"""Append-only, crash-safe HDF5 trace writer.

The capture side hands over one `StepBatch` per step (plain numpy arrays, offsets relative to the
batch); at the last step end before the oldest waiting batch is 0.8 x `flush_interval` old, the
submitting thread appends what waits to the column datasets and flushes (a background thread
does it at 0.9 x `flush_interval` when no step comes in time), so a batch is on disk within
`flush_interval`. The file runs in HDF5 single-writer/multiple-reader (SWMR) mode, so a
process killed with SIGKILL leaves a file that opens (with `swmr=True`, which the reader does for
you) and holds every batch flushed before the kill. Nothing here imports torch.

Write order within a flush: flat arrays, records, snapshots, then the step rows, then flush; a
step row on disk therefore always has its records on disk.

The batches are trace/batch.py's; how their bytes reach the datasets (low-level appends, ring
slots, the byte cap) is trace/columns.py's.

The file's layout at creation, and edits of closed traces, are trace/layout.py's.

Format 1.1 adds the flight recorder's pieces (docs/trace-format.md, "Channel keeping"): a batch
marked `ring` writes its channel block in place into slot step % K of the fixed-size `/ring`
(never appended), `promote` copies earlier ring blocks into `/channels`, `triggers` go to
`/triggers`.

Format 1.2 holds one byte budget for any duration (trace/budget.py): every step's summary goes
to the fixed-size `/summary`; once the next flush of full detail could pass `max_bytes` less the
room held back for the pinned windows, appending of full detail stops (noted in `/limits` and
the closing status), the ring keeps the last K steps' full detail in place, and the first
failure (and the first step of each trigger kind) is appended with its window into the room
held back for it.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import replace
from typing import Any

import numpy as np

from qforensics.trace import schema
from qforensics.trace import layout
from qforensics.trace.batch import StepBatch, rebase_channels, merge_batches
from qforensics.trace.budget import BudgetWriter, engine_step
from qforensics.trace.fallback import FallbackWriter, flushed_rows
from qforensics.trace.hits import HitsWriter
from qforensics.trace.columns import ColumnWriter, batch_rows
from qforensics.trace.layout import STATUS_BYTES, compact_trace, json_attr, set_meta  # noqa: F401

__all__ = ["StepBatch", "TraceWriter", "compact_trace", "merge_batches", "set_meta"]

log = logging.getLogger(__name__)

_clock = time.monotonic  # the schedule's clock (a test drives it)



def _vfd(f: Any) -> int | None:
    """The file descriptor HDF5 writes through (the default sec2 driver), else None."""
    try:
        return int(f.id.get_vfd_handle())
    except Exception:  # noqa: BLE001 - another driver
        return None


class _Barrier:
    """Queued by `TraceWriter.flush`: set once everything queued before it is on disk."""

    def __init__(self) -> None:
        self.done = threading.Event()


class TraceWriter(FallbackWriter, BudgetWriter, HitsWriter, ColumnWriter):
    """Owns one trace file. Thread-safe `submit`; `close` drains everything and seals the file."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        modules: list[dict[str, str]],
        environment: dict[str, Any],
        capture_options: dict[str, Any],
        channel_dtype: str = "float32",
        flush_interval: float = 1.0,
        ring_slots: int = 0,
        max_bytes: int | None = None,
        ring_chunk: int = 4096,
    ) -> None:
        self.path = os.fspath(path)
        self.flush_interval = float(flush_interval)
        self.channel_dtype = np.dtype(channel_dtype)
        if self.channel_dtype not in (np.dtype("f4"), np.dtype("f2")):
            raise ValueError("channel_dtype must be float32 or float16")
        # Batches wait here. The thread that submits writes them itself, at the end of its
        # step: the cost is then its CPU time, whereas a writer thread holding the GIL in h5py
        # calls while the model thread waits for it (after every torch op) costs the run
        # several times that. Each write has a fixed cost (one append per column, the flush),
        # so it writes as seldom as the promise allows: at the last step end before the oldest
        # waiting batch would pass `_budget` (the step's length estimated from the gaps between
        # submits). The writer thread only writes what waited `_deadline` (a long step, an
        # idle server), and at once for flush / close.
        self._items: collections.deque[StepBatch | _Barrier | None] = collections.deque()
        self._wake = threading.Event()
        self._urgent = False  # a barrier or close is queued: the writer thread drains now
        self._drain = threading.Lock()  # one drainer at a time: batches stay in order
        self._budget = 0.8 * self.flush_interval
        self._deadline = 0.9 * self.flush_interval
        self._oldest: float | None = None  # when the oldest waiting batch was submitted
        self._last_submit: float | None = None
        self._step_s = 0.0  # running estimate of the time between two submits
        self._failed: str | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.steps_written = 0
        self.bytes_hint = 0
        self.ring_slots = max(0, int(ring_slots))
        self.ring_chunk = min(1 << 20, max(256, int(ring_chunk)))
        self.max_bytes = int(max_bytes) if max_bytes else 0
        self.capped_at: int | None = None  # step at which max_bytes was reached
        self.plan_budget(modules, capture_options)  # CaptureError when the options cannot hold
        self._create(modules, environment, capture_options)
        self._thread = threading.Thread(target=self._run, name="qforensics-writer", daemon=True)
        self._thread.start()

    # -- file layout -------------------------------------------------------------------------
    def _create(self, modules: list[dict[str, str]], environment: dict, options: dict) -> None:
        f, self._cols = layout.create_file(
            self.path, modules, environment, options, channel_dtype=self.channel_dtype,
            ring_slots=self.ring_slots, ring_chunk=self.ring_chunk, max_bytes=self.max_bytes)
        self._create_budget(f)
        f.flush()
        f.swmr_mode = True
        self._file = f
        self._fd = _vfd(f)
        # lengths of the appendable datasets, kept here (h5py's .shape is a library call)
        self._len = {p: int(ds.shape[0]) for p, ds in self._cols.items()}
        # the lengths as of the last flush that completed: a flush that fails can leave the
        # rows it appended torn on disk (some columns written, some not; trace/fallback.py)
        self._flushed = dict(self._len)
        self._geo: dict[str, tuple[int, int, tuple[int, ...]]] = {}


    # -- producer side -----------------------------------------------------------------------
    def submit(self, batch: StepBatch) -> None:
        if self._closed:  # after a failed write still queued: kept in memory (trace/fallback.py)
            return
        now = _clock()
        if self._last_submit is not None:
            gap = min(now - self._last_submit, self._budget)  # an idle server's pause is no step
            self._step_s = 0.75 * self._step_s + 0.25 * gap if self._step_s else gap
        self._last_submit = now
        self._items.append(batch)
        # appended first, then noted: a drainer clears `_oldest` before it takes the items, so
        # `_oldest` is never later than the oldest batch that waits (at worst earlier)
        oldest = self._oldest
        if oldest is None:
            self._oldest = oldest = now
            self._wake.set()  # the writer thread's deadline starts now
        if now - oldest + self._step_s >= self._budget and self._drain.acquire(False):
            try:
                self._drain_items()
            finally:
                self._drain.release()

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Block until every batch submitted before this call is written and flushed to disk (a
        barrier: no sleeping and hoping). False on timeout or when writing has failed."""
        if self._closed:
            return self._failed is None
        barrier = _Barrier()
        self._items.append(barrier)
        self._urgent = True
        self._wake.set()
        return barrier.done.wait(timeout) and self._failed is None

    @property
    def failed(self) -> str | None:
        return self._failed

    # -- writer thread -----------------------------------------------------------------------
    def _run(self) -> None:
        stop = False
        while not stop:
            # a batch is on disk within `_deadline` of its submit plus the write itself: the
            # submitting thread writes before `_budget`, this thread after `_deadline` (a step
            # longer than expected, or no steps at all)
            oldest = self._oldest
            self._wake.wait(None if oldest is None else
                            max(0.0, oldest + self._deadline - _clock()))
            self._wake.clear()
            oldest = self._oldest
            if self._urgent or (oldest is not None
                                and _clock() - oldest >= self._deadline):
                with self._drain:
                    self._urgent = False
                    stop = self._drain_items()

    def _drain_items(self) -> bool:
        """Write everything queued (caller holds `_drain`); True when close was queued."""
        pending: list[StepBatch] = []
        barriers: list[_Barrier] = []
        stop = False
        self._oldest = None  # before taking the items: see submit
        try:
            while self._items:
                item = self._items.popleft()
                if item is None:
                    stop = True
                elif isinstance(item, _Barrier):
                    barriers.append(item)
                else:
                    pending.append(item)
            if pending:
                self._write(pending)
        finally:
            for b in barriers:
                b.done.set()
        return stop

    def _write(self, batches: list[StepBatch]) -> None:
        if self._failed:
            self._remember(batches)
            return
        noted = False
        try:
            with self._lock:
                self._note(batches)  # summaries, the per-step estimate
                noted = True
                self._note_hits(batches)  # where each request first held NaN/Inf
                self._write_params(batches)  # parameters seen non-finite in the run
                # one resize + write per dataset per flush, not per step: h5py's per-call
                # overhead (and the GIL it holds) is what a writer thread costs the run
                empty = np.zeros(0, self.channel_dtype)
                stripped = [replace(b, chan_min=empty, chan_max=empty, ring=False) if b.ring
                            else b for b in batches]  # ring blocks: in place, not appended
                appended = self._append_fitting(stripped)
                # a ring slot written twice in one go keeps only its last block; a step whose
                # full detail was not appended goes to the ring whole
                last_in_slot = {}
                if self.ring_slots:
                    for i, b in enumerate(batches):
                        if (b.ring or not appended[i]) and len(b.steps):
                            last_in_slot[int(b.steps["step"][0]) % self.ring_slots] = i
                for i in last_in_slot.values():
                    b = batches[i]
                    if not appended[i]:
                        self._write_ring_detail(b)
                    elif len(b.chan_min):
                        self._write_ring(b)
                self._pin(batches, stripped, appended)
                self._write_summary()
                self._file.flush()
                self._flushed = dict(self._len)
                self.steps_written += sum(len(b.steps) for b in batches)
        except Exception as exc:  # disk full, file removed, ...: degrade, never raise into the run
            self._fail(exc, batches, noted)

    def _write_params(self, batches: list[StepBatch]) -> None:
        """Append /param_watch rows whatever the detail cap: at most one row per tensor for
        the run, taken from the room kept for the requests table when a budget is set (like
        /engine/hits), so a corrupt weight found before full detail stopped is never lost."""
        rows = [b.params for b in batches if len(b.params)]
        if not rows:
            return
        watch = np.concatenate(rows) if len(rows) > 1 else rows[0]
        self._append_table("param_watch", schema.PARAM_WATCH_COLUMNS, watch)
        if self.max_bytes:
            self._req_used += len(watch) * watch.dtype.itemsize

    def _append_fitting(self, batches: list[StepBatch]) -> list[bool]:
        """Append the batches while they fit the budget (one merged append when all do);
        which ones were appended."""
        if self.capped_at is not None:
            return [False] * len(batches)
        merged = merge_batches(batches) if len(batches) > 1 else batches[0]
        if not self.max_bytes or self._within_cap(self._batch_growth(merged) + self._reserve()):
            self._append_batch(merged)
            return [True] * len(batches)
        # the drain that reaches the budget: the longest run of its steps that fits, found by
        # bisection over the cumulative row counts (one merge, one append)
        counts = [batch_rows(b) for b in batches]
        paths = list(counts[0])
        cum = np.cumsum([[c.get(p, 0) for p in paths] for c in counts], axis=0)
        reserve = self._reserve()
        lo, hi = 0, len(batches) - 1  # batches[:lo] fit; batches[:hi + 1] do not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._within_cap(self._growth(dict(zip(paths, cum[mid - 1].tolist())))
                                + reserve):
                lo = mid
            else:
                hi = mid - 1
        if lo:
            self._append_batch(merge_batches(batches[:lo]) if lo > 1 else batches[0])
        # the first step left out (an engine's own batch of a step names it too)
        self._reach_cap(next((int(b.steps["step"][0]) if len(b.steps) else engine_step(b)
                              for b in batches[lo:] if len(b.steps) or engine_step(b) >= 0),
                             -1))
        return [i < lo for i in range(len(batches))]

    def _append_batch(self, b: StepBatch) -> None:
        for step, pmin, pmax in b.promote:  # ring blocks kept for good after a trigger
            off = self._append("channels/min", np.asarray(pmin, self.channel_dtype))
            self._append("channels/max", np.asarray(pmax, self.channel_dtype))
            row = np.zeros(1, [(n, t) for n, t, _ in schema.PROMOTED_COLUMNS])
            row["step"], row["offset"], row["count"] = step, off, len(pmin)
            self._append_table("channels/promoted", schema.PROMOTED_COLUMNS, row)
        if len(b.triggers):
            self._append_table("triggers", schema.TRIGGER_COLUMNS, b.triggers)
        cmin = np.asarray(b.chan_min, dtype=self.channel_dtype)
        cmax = np.asarray(b.chan_max, dtype=self.channel_dtype)
        chan_base = self._append("channels/min", cmin)
        self._append("channels/max", cmax)
        tok_base = self._append("tokens/absmax", np.asarray(b.tok_absmax, np.float32))
        ids_base = self._append("tokens/input_ids", np.asarray(b.input_ids, np.int64))
        rec = b.records.copy()
        rebase_channels(rec, chan_base)
        rec["tok_offset"] = np.where(rec["tok_offset"] >= 0, rec["tok_offset"] + tok_base, -1)
        rec_base = self._append_table("records", schema.RECORD_COLUMNS, rec)
        if len(b.snapshots):
            data_base = self._append("snapshots/data", np.asarray(b.snapshot_bytes, np.uint8))
            snaps = b.snapshots.copy()
            snaps["offset"] += data_base
            self._append_table("snapshots/index", schema.SNAPSHOT_COLUMNS, snaps)
        if len(b.incidents):
            self._append_table("incidents", schema.INCIDENT_COLUMNS, b.incidents)
        for table, rows in b.engine.items():
            if len(rows):
                self._append_table(f"engine/{table}", schema.ENGINE_TABLES[table], rows)
        steps = b.steps.copy()
        steps["record_offset"] += rec_base
        steps["token_offset"] += ids_base
        steps["first_nonfinite_record"] = np.where(
            steps["first_nonfinite_record"] >= 0, steps["first_nonfinite_record"] + rec_base, -1
        )
        self._append_table("steps", schema.STEP_COLUMNS, steps)
        self.bytes_hint += cmin.nbytes * 2 + rec.nbytes

    # -- closing -----------------------------------------------------------------------------
    def close(self, status: dict[str, Any] | None = None) -> None:
        """Drain the queue, flush, close, then seal the file with its status (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._items.append(None)
        self._urgent = True
        self._wake.set()
        self._thread.join(timeout=60)
        st = dict(status or {})
        st.setdefault("state", "complete")
        st["steps_written"] = self.steps_written
        if self.capped_at is not None:
            st["max_bytes_reached"] = {"max_bytes": self.max_bytes, "step": self.capped_at}
        st["pinned"] = {"kept": self.pins_kept, "dropped": self.pins_dropped,
                        "kinds": sorted(self._pinned)}
        if self.hits_dropped:
            st["hits_dropped"] = self.hits_dropped
        if self.detail_off:
            st["ring_detail_off"] = self.detail_off
        sealed = False
        try:
            with self._lock:
                if not self._failed:
                    try:  # the last drain's data, before the status says it is there
                        self._file.flush()
                        self._flushed = dict(self._len)
                    except Exception as exc:  # noqa: BLE001 - the disk filled up just now
                        self._fail(exc, [], True)
                if self._failed:  # raw bytes into the fixed regions, then let go (fallback.py)
                    try:
                        st["writer_error"] = self._failed[:400]
                        st["writer_failed_at_step"] = self._failed_at
                        # rows past these may be torn on disk: the reader leaves them out
                        st["rows_flushed"] = flushed_rows(self._flushed)
                        st["memory_ring"] = self._write_memory()
                        self._raw_status(st)
                    finally:
                        self._detach()
                    sealed = True
                else:
                    sealed = self._seal_in_place(st)
                self._file.close()
        except Exception as exc:
            log.error("qforensics: closing the trace failed: %s", exc)
            return
        if sealed:
            return
        try:  # a status longer than its reserved slot, or a file without the slot
            set_meta(self.path, "status", st)
        except Exception as exc:
            log.error("qforensics: could not write the trace status: %s", exc)


    def _seal_in_place(self, st: dict[str, Any]) -> bool:
        """Write the status into its reserved slot and flush, in SWMR mode; False when it does
        not fit (caller holds `_lock`)."""
        raw = json_attr(st).encode()
        if len(raw) > STATUS_BYTES:
            return False
        try:
            self._file["meta"].attrs.modify("status", np.bytes_(raw.ljust(STATUS_BYTES)))
            self._file.flush()
        except Exception as exc:  # noqa: BLE001 - the slot is missing or unwritable: reopen
            log.warning("qforensics: status slot not written (%s); sealing after close", exc)
            self._detach()  # a failed write: HDF5 must not be left half-closed (fallback.py)
            return False
        return True
