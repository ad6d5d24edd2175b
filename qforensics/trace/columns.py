"""How bytes reach the trace file: appends to the column datasets through h5py's low-level calls,
the ring slots written as whole chunks, and the `max_bytes` cap checked before each append.

A mixin of `TraceWriter` (trace/writer.py), which owns the file and its datasets (`_cols`, their
lengths `_len`) and runs these on its writer thread only.
"""

from __future__ import annotations

import logging
import os

import h5py
import numpy as np

from qforensics.trace import schema
from qforensics.trace.batch import StepBatch, resolve_channels

log = logging.getLogger("qforensics.trace.writer")


def put_at(ds: h5py.Dataset, i: int, value: int) -> None:
    """ds[i] = value for a small 1-d int64 dataset, through h5py's low-level write."""
    fspace = ds.id.get_space()
    fspace.select_hyperslab((i,), (1,))
    ds.id.write(h5py.h5s.create_simple((1,)), fspace, np.array([value], np.int64))


def batch_rows(b: StepBatch) -> dict[str, int]:
    """Rows appending `b` adds to each appendable dataset."""
    n_chan = len(b.chan_min) + sum(len(p[1]) for p in b.promote)
    rows = {"channels/min": n_chan, "channels/max": n_chan,
            "tokens/absmax": len(b.tok_absmax), "tokens/input_ids": len(b.input_ids),
            "snapshots/data": len(b.snapshot_bytes)}
    for table, columns, n in (("steps", schema.STEP_COLUMNS, len(b.steps)),
                              ("records", schema.RECORD_COLUMNS, len(b.records)),
                              ("snapshots/index", schema.SNAPSHOT_COLUMNS, len(b.snapshots)),
                              ("incidents", schema.INCIDENT_COLUMNS, len(b.incidents)),
                              ("triggers", schema.TRIGGER_COLUMNS, len(b.triggers)),
                              ("channels/promoted", schema.PROMOTED_COLUMNS, len(b.promote))):
        rows.update((f"{table}/{name}", n) for name, _, _ in columns)
    for table, tab in b.engine.items():
        rows.update((f"engine/{table}/{name}", len(tab))
                    for name, _, _ in schema.ENGINE_TABLES[table])
    return rows


class ColumnWriter:
    _cols: dict[str, h5py.Dataset]
    _len: dict[str, int]
    _geo: dict[str, tuple[int, int, tuple[int, ...]]]
    _file: h5py.File
    path: str
    max_bytes: int
    capped_at: int | None
    ring_slots: int
    channel_dtype: np.dtype

    def _fits(self, b: StepBatch) -> bool:
        """False (and the cap noted in /limits) when appending `b` could pass max_bytes less
        the room held back for the pinned windows (trace/budget.py)."""
        if not self.max_bytes:
            return True
        if self._within_cap(self._batch_growth(b) + self._reserve()):
            return True
        self._reach_cap(int(b.steps["step"][0]) if len(b.steps) else -1)
        return False

    def _reserve(self, taking: tuple[str, ...] = ()) -> int:  # trace/budget.py
        return 0

    def _batch_growth(self, b: StepBatch) -> int:
        """Upper bound of the bytes appending `b` allocates."""
        return self._growth(batch_rows(b))

    def _growth(self, rows: dict[str, int]) -> int:
        """Upper bound of the bytes appending so many rows to each dataset allocates."""
        return sum(self._chunk_growth(p, n) for p, n in rows.items())

    def _chunk_growth(self, path: str, n: int) -> int:
        """Upper bound of the bytes appending n rows to a dataset allocates: whole chunks,
        uncompressed (compression only shrinks them)."""
        if n <= 0:
            return 0
        c, row, _ = self._geometry(path)
        have = self._len[path]
        # a compressed open chunk is rewritten elsewhere when it grows: one more chunk
        again = 1 if have % c and self._cols[path].compression else 0
        return (-(-(have + n) // c) - -(-have // c) + again) * c * row

    def _geometry(self, path: str) -> tuple[int, int, tuple[int, ...]]:
        """(rows per chunk, bytes per row, row shape) of an appendable dataset, read once."""
        g = self._geo.get(path)
        if g is None:
            ds = self._cols[path]
            inner = tuple(int(x) for x in ds.shape[1:])
            g = self._geo[path] = (ds.chunks[0] if ds.chunks else 1,
                                   ds.dtype.itemsize * int(np.prod(inner, dtype=np.int64)),
                                   inner)
        return g

    def _within_cap(self, extra: int) -> bool:
        if not self.max_bytes:
            return True
        # HDF5 gives appended rows (a widened dataset) their chunks only when it flushes
        # them: until then the size on disk leaves them out. A flush with nothing to write
        # costs ~2 us, and a write checks a handful of times
        self._file.flush()
        # 64 KiB for HDF5's own metadata (B-tree nodes, heaps) that a flush may add
        return os.path.getsize(self.path) + extra + (64 << 10) <= self.max_bytes

    def _reach_cap(self, first: int) -> None:
        self.capped_at = first
        self._cols[schema.LIMITS_DATASET][1] = first
        log.warning("qforensics: trace reached max_bytes=%d at step %d; appending of full detail "
                    "stops: every step's summary, the last steps in the ring and the pinned "
                    "failure windows are kept", self.max_bytes, first)

    def _write_ring(self, b: StepBatch, always: bool = False) -> None:
        """The step's channel block into slot step % K of the fixed-size circular region
        (`always`: the slot holds the step's detail, so it names the step even when the block
        does not fit)."""
        if not self.ring_slots or not len(b.steps):
            return
        step = int(b.steps["step"][0])
        slot = step % self.ring_slots
        if not resolve_channels(b):  # its ranges left the op's ring: the slot names the step
            put_at(self._cols["ring/count"], slot, 0)
            put_at(self._cols["ring/step"], slot, step)
            return
        n = len(b.chan_min)
        dmin, dmax = self._cols["ring/min"], self._cols["ring/max"]
        if n > dmin.shape[1]:
            width = -(-n // 4096) * 4096
            if self.capped_at is not None or not self._within_cap(
                    2 * dmin.shape[0] * (width - dmin.shape[1]) * dmin.dtype.itemsize
                    + self._reserve()):
                if self.capped_at is None:
                    self._reach_cap(step)
                if always:
                    put_at(self._cols["ring/count"], slot, 0)
                    put_at(self._cols["ring/step"], slot, step)
                return
            dmin.resize((dmin.shape[0], width))
            dmax.resize((dmax.shape[0], width))
        put_at(self._cols["ring/step"], slot, -1)  # invalid while the slot is rewritten
        # whole chunks straight to the file (the ring has no filters): HDF5's chunk cache and
        # selection machinery cost several times the copy itself at this size
        width = dmin.chunks[1]
        last = np.zeros(width, self.channel_dtype)
        for ds, values in ((dmin, b.chan_min), (dmax, b.chan_max)):
            v = np.ascontiguousarray(values, self.channel_dtype)
            for c0 in range(0, n, width):
                chunk = v[c0:c0 + width]
                if len(chunk) < width:  # the edge chunk, padded
                    last[:len(chunk)] = chunk
                    last[len(chunk):] = 0
                    chunk = last
                ds.id.write_direct_chunk((slot, c0), chunk)
        put_at(self._cols["ring/count"], slot, n)
        put_at(self._cols["ring/step"], slot, step)

    def _append(self, path: str, values: np.ndarray) -> int:
        """Append rows; returns the dataset's length before them. Numeric columns go through
        h5py's low-level calls (one extent change, one hyperslab write): the high-level
        resize + slice assignment costs several times more per call, and the writer makes
        dozens of these per flush."""
        ds = self._cols[path]
        n = self._len[path]
        m = len(values)
        if m:
            _, _, inner = self._geometry(path)
            arr = np.asarray(values)
            if arr.dtype.kind in "iuf" and arr.shape[1:] == inner:
                arr = np.ascontiguousarray(arr, dtype=ds.dtype)
                ds.id.set_extent((n + m, *inner))
                fspace = ds.id.get_space()
                fspace.select_hyperslab((n, *([0] * len(inner))), (m, *inner))
                ds.id.write(h5py.h5s.create_simple((m, *inner)), fspace, arr)
            else:
                ds.resize((n + m, *inner))
                ds[n:] = values
            self._len[path] = n + m
        return n

    def _append_table(self, table: str, columns: list, rows: np.ndarray) -> int:
        base = self._len[f"{table}/{columns[0][0]}"]
        for name, _, _ in columns:
            self._append(f"{table}/{name}", rows[name])
        return base
