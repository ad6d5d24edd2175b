"""What `TraceWriter` does once writing fails (disk full, a file size limit, the file removed):
capture goes on in memory, the host never sees an error.

From the failed write on, nothing is appended. Every later batch still has its summary folded
in (trace/budget.py's `_note`, in memory), and the last K of them (K: the ring's slots, at
least 16) stay in memory whole. At close the writer tries once to put them where no new room
is needed: the summaries into the fixed-size `/summary`, the K steps into their ring slots
(allocated once the ring has turned). The status says from which step writing failed and
whether that last write took (`writer_error`, `writer_failed_at_step`, `memory_ring`), and how
many rows each appended table had at the last flush that completed (`rows_flushed`): the failed
flush may have put some of its rows on disk and not others (one column's chunk written, the
next one's not; a step row whose records read as finite zeros), so the reader leaves the rows
past those counts out (trace/reader.py) and the ring and the summaries speak for those steps.
analyze/coverage.py (`_written`) turns that into what the verdict covers, and the reader takes
the status from `/status_raw` (trace/reader.py's `meta`).

A mixin of `TraceWriter`; nothing here imports torch.
"""

from __future__ import annotations

import collections
import logging
import os
from typing import Any

import numpy as np

from qforensics.trace import schema
from qforensics.trace.batch import StepBatch, resolve_channels
from qforensics.trace.layout import json_attr
from qforensics.trace.rawput import RawRegion

log = logging.getLogger("qforensics.trace.writer")

_MIN_KEPT = 16  # steps kept in memory without a ring


def flushed_rows(lengths: dict[str, int]) -> dict[str, int]:
    """The rows of each appended table as of the last flush that completed, by the reader's
    names (`steps`, `records`, `snapshots/index`, `incidents`, `engine/<table>` and the flat
    arrays), from the writer's per-column lengths then (`TraceWriter._flushed`)."""
    tables = {"steps": schema.STEP_COLUMNS, "records": schema.RECORD_COLUMNS,
              "snapshots/index": schema.SNAPSHOT_COLUMNS, "incidents": schema.INCIDENT_COLUMNS,
              **{f"engine/{t}": cols for t, cols in schema.ENGINE_TABLES.items()}}
    out: dict[str, int] = {}
    for table, cols in tables.items():
        have = [lengths[f"{table}/{c[0]}"] for c in cols if f"{table}/{c[0]}" in lengths]
        if have:
            out[table] = int(min(have))
    out.update((p, int(lengths[p])) for p in schema.FLAT_ARRAYS if p in lengths)
    return out


class FallbackWriter:
    """In-memory keeping after a failed write (the drainer only)."""

    _failed: str | None
    _failed_at: int = -1
    _memory: collections.deque | None = None

    def _fail(self, exc: BaseException, batches: list[StepBatch], noted: bool) -> None:
        """The write of `batches` failed (`noted`: their summaries are already folded in):
        say so once, keep them in memory from now on."""
        self._failed = f"{type(exc).__name__}: {exc}"
        firsts = [int(b.steps["step"][0]) for b in batches if len(b.steps)]
        self._failed_at = min(firsts) if firsts else -1
        self._memory = collections.deque(maxlen=int(getattr(self, "ring_slots", 0)) or _MIN_KEPT)
        log.error("qforensics: trace writing failed at step %d (%s); the run continues, "
                  "capture goes on in memory (summaries and the last %d steps, written at "
                  "close where they fit)", self._failed_at, self._failed, self._memory.maxlen)
        self._remember(batches, noted)

    def _remember(self, batches: list[StepBatch], noted: bool = False) -> None:
        """A batch after the failure: its summary folded in, the batch kept among the last K."""
        try:
            if not noted:
                self._note(batches)  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - an allocation it tried needed the disk
            pass
        assert self._memory is not None
        self._memory.extend(b for b in batches if len(b.steps))

    def _write_memory(self) -> dict[str, Any]:
        """At close (caller holds `_lock`): the summaries and the steps kept in memory into
        their fixed places in the file, as raw bytes (trace/rawput.py: HDF5's own writes fail
        from here on); what took, for the status."""
        kept = list(self._memory or ())
        out: dict[str, Any] = {"steps": [int(kept[0].steps["step"][0]),
                                         int(kept[-1].steps["step"][0])] if kept else [],
                               "summaries": False, "ring": 0}
        fd = getattr(self, "_fd", None)
        if fd is None:
            out["error"] = "no file descriptor to write through (not the sec2 driver)"
            return out
        cols = self._cols  # type: ignore[attr-defined]
        try:
            raw = RawRegion(fd)
            s = self._summaries  # type: ignore[attr-defined]
            raw.put(cols[schema.SUMMARY_BLOCKS], 0, s.rows)
            raw.put(cols[schema.SUMMARY_STATE], 0, s.state())
            out["summaries"] = True
            for b in kept if getattr(self, "ring_slots", 0) else ():
                self._raw_ring_slot(raw, b)
                out["ring"] += 1
        except Exception as exc:  # noqa: BLE001 - h5py raises RuntimeError for HDF5's own
            out["error"] = f"{type(exc).__name__}: {exc}"[:400]
        return out

    def _raw_ring_slot(self, raw: RawRegion, b: StepBatch) -> None:
        """One kept step into its ring slot, in the order `_write_ring_detail` keeps: the
        slot names no step while it is rewritten."""
        cols = self._cols  # type: ignore[attr-defined]
        step = int(b.steps["step"][0])
        slot = step % self.ring_slots  # type: ignore[attr-defined]
        raw.put(cols["ring/step"], slot, np.array([-1], np.int64))
        r_cap, _ = self._detail_shape  # type: ignore[attr-defined]
        rec, tok, row = self._ring_detail_rows(b)  # type: ignore[attr-defined]
        if r_cap and len(rec):
            raw.put_row(cols[schema.RING_RECORDS], slot, rec)
        if r_cap and len(tok):
            raw.put_row(cols[schema.RING_TOKENS], slot, tok)
        raw.put(cols[schema.RING_STEPS], slot, row)
        raw.put(cols[schema.RING_DETAIL], 2 * slot,
                np.array([len(rec) if r_cap else 0, len(tok) if r_cap else 0], np.int64))
        n = len(b.chan_min) if resolve_channels(b) else 0
        dmin = cols["ring/min"]
        if n and n <= dmin.shape[1]:
            raw.put_row(dmin, slot, np.asarray(b.chan_min, dmin.dtype))
            raw.put_row(cols["ring/max"], slot, np.asarray(b.chan_max, dmin.dtype))
        else:
            n = 0
        raw.put(cols["ring/count"], slot, np.array([n], np.int64))
        raw.put(cols["ring/step"], slot, np.array([step], np.int64))

    def _raw_status(self, st: dict[str, Any]) -> bool:
        """The closing status into `/status_raw` (trace/layout.py), where the reader looks
        when /meta@status was never sealed."""
        fd = getattr(self, "_fd", None)
        ds = self._cols.get(schema.STATUS_RAW)  # type: ignore[attr-defined]
        if fd is None or ds is None:
            return False
        data = json_attr(st).encode()
        if len(data) > ds.shape[0]:
            return False
        buf = np.zeros(ds.shape[0], np.uint8)
        buf[:len(data)] = np.frombuffer(data, np.uint8)
        try:
            RawRegion(fd).put(ds, 0, buf)
        except Exception as exc:  # noqa: BLE001
            log.error("qforensics: the trace status could not be written: %s", exc)
            return False
        return True

    def _detach(self) -> None:
        """Point the descriptor HDF5 writes through at /dev/null, so that the close completes.
        A close whose writes fail leaves the file half-closed in HDF5, and the close HDF5
        retries when the process exits crashed the host (SIGSEGV in H5D__flush_all_cb, h5py
        3.16 / HDF5 2.0, seen with a file size limit). What reached the disk before stays as
        it is (the reader opens it, and says what it lacks); the rest is dropped."""
        fd = getattr(self, "_fd", None)
        if fd is None:
            return
        try:
            null = os.open(os.devnull, os.O_RDWR)
            try:
                os.dup2(null, fd)
            finally:
                os.close(null)
        except OSError as exc:
            log.error("qforensics: the trace file could not be detached: %s", exc)
