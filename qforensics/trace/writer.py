"""Append-only, crash-safe HDF5 trace writer.

The capture side hands over one `StepBatch` per step (plain numpy arrays, offsets relative to the
batch); a background thread appends batches to column datasets and flushes at least every
`flush_interval` seconds. The file runs in HDF5 single-writer/multiple-reader (SWMR) mode, so a
process killed with SIGKILL leaves a file that opens (with `swmr=True`, which the reader does for
you) and holds every batch flushed before the kill. Nothing here imports torch.

Write order within a flush: flat arrays, records, snapshots, then the step rows, then flush; a
step row on disk therefore always has its records on disk.

Format 1.1 adds the flight recorder's pieces (docs/trace-format.md, "Channel keeping"): a batch
marked `ring` writes its channel block in place into slot step % K of the fixed-size `/ring`
(never appended), `promote` copies earlier ring blocks into `/channels`, `triggers` go to
`/triggers`; `max_bytes` stops every append once the next flush could pass it (noted in
`/limits` and the closing status) while the ring keeps turning.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import h5py
import numpy as np

from qforensics.version import __version__
from qforensics.trace import schema

log = logging.getLogger(__name__)

_COMPRESSION = {"compression": "gzip", "compression_opts": 4, "shuffle": True}


@dataclass
class StepBatch:
    """Everything one step produced. Offsets inside are relative to this batch's own arrays."""

    steps: np.ndarray  # structured, schema.step_dtype(), usually one row
    records: np.ndarray  # structured, schema.record_dtype()
    chan_min: np.ndarray  # flat
    chan_max: np.ndarray
    tok_absmax: np.ndarray  # flat float32
    input_ids: np.ndarray  # flat int64
    snapshots: np.ndarray = field(default_factory=lambda: np.zeros(0, schema.snapshot_dtype()))
    snapshot_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    incidents: np.ndarray = field(default_factory=lambda: np.zeros(0, schema.incident_dtype()))
    # /engine/<table> rows (schema.ENGINE_TABLES); self-describing, nothing to rebase
    engine: dict[str, np.ndarray] = field(default_factory=dict)
    # 1.1: this step's channel block goes to the ring (its records carry FLAG_RING and offsets
    # relative to the block), earlier ring blocks to keep for good, and the triggers it crossed
    ring: bool = False
    promote: list[tuple[int, np.ndarray, np.ndarray]] = field(default_factory=list)
    triggers: np.ndarray = field(default_factory=lambda: np.zeros(0, schema.trigger_dtype()))


def _rebase_channels(rec: np.ndarray, base: int) -> None:
    """Shift the absolute channel offsets of records by `base` (ring-relative ones stay)."""
    absolute = (rec["chan_offset"] >= 0) & ((rec["flags"] & schema.FLAG_RING) == 0)
    rec["chan_offset"] = np.where(absolute, rec["chan_offset"] + base, rec["chan_offset"])


def merge_batches(batches: list[StepBatch]) -> StepBatch:
    """Concatenate consecutive step batches, rebasing their relative offsets."""
    recs, steps, snaps = [], [], []
    chan = tok = ids = data = rec_base = 0
    for b in batches:
        r = b.records.copy()
        _rebase_channels(r, chan)
        r["tok_offset"] = np.where(r["tok_offset"] >= 0, r["tok_offset"] + tok, -1)
        st = b.steps.copy()
        st["record_offset"] += rec_base
        st["token_offset"] += ids
        st["first_nonfinite_record"] = np.where(st["first_nonfinite_record"] >= 0,
                                                st["first_nonfinite_record"] + rec_base, -1)
        sn = b.snapshots.copy()
        sn["offset"] += data
        recs.append(r)
        steps.append(st)
        snaps.append(sn)
        chan += len(b.chan_min)
        tok += len(b.tok_absmax)
        ids += len(b.input_ids)
        data += len(b.snapshot_bytes)
        rec_base += len(r)
    return StepBatch(
        steps=np.concatenate(steps), records=np.concatenate(recs),
        chan_min=np.concatenate([b.chan_min for b in batches]),
        chan_max=np.concatenate([b.chan_max for b in batches]),
        tok_absmax=np.concatenate([b.tok_absmax for b in batches]),
        input_ids=np.concatenate([b.input_ids for b in batches]),
        snapshots=np.concatenate(snaps),
        snapshot_bytes=np.concatenate([b.snapshot_bytes for b in batches]),
        incidents=np.concatenate([b.incidents for b in batches]),
        engine={t: np.concatenate([b.engine[t] for b in batches if t in b.engine])
                for t in schema.ENGINE_TABLES if any(t in b.engine for b in batches)},
        promote=[p for b in batches for p in b.promote],
        triggers=np.concatenate([b.triggers for b in batches]),
    )


# rows per chunk: a flush recompresses each open chunk whole, so the one-row-per-step table
# gets small chunks
_TABLE_CHUNKS = {"steps": 256, "records": 2048}


def _put(ds: h5py.Dataset, i: int, value: int) -> None:
    """ds[i] = value for a small 1-d int64 dataset, through h5py's low-level write."""
    fspace = ds.id.get_space()
    fspace.select_hyperslab((i,), (1,))
    ds.id.write(h5py.h5s.create_simple((1,)), fspace, np.array([value], np.int64))


def _table_compression(dt: Any) -> dict[str, Any]:
    """Per-step table columns: integer columns (indices, counts, offsets) shrink several-fold
    under gzip for little CPU; float statistics are noise that gzip barely shrinks, while every
    flush would recompress their open chunk (the writer thread's largest cost). Stored raw."""
    return {} if np.dtype(dt).kind == "f" else _COMPRESSION


def _json_attr(obj: Any) -> str:
    return json.dumps(obj, default=str, allow_nan=True, sort_keys=True)


class _Barrier:
    """Queued by `TraceWriter.flush`: set once everything queued before it is on disk."""

    def __init__(self) -> None:
        self.done = threading.Event()


class TraceWriter:
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
        # submit appends here without waking the writer (a wake-up per step is a thread switch
        # and a GIL hand-over in the middle of the run); the writer drains it on its own
        # schedule, and at once for a barrier or close (`_wake`)
        self._items: collections.deque[StepBatch | _Barrier | None] = collections.deque()
        self._wake = threading.Event()
        self._failed: str | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.steps_written = 0
        self.bytes_hint = 0
        self.ring_slots = max(0, int(ring_slots))
        self.ring_chunk = min(1 << 20, max(256, int(ring_chunk)))
        self.max_bytes = int(max_bytes) if max_bytes else 0
        self.capped_at: int | None = None  # step at which max_bytes was reached
        self._create(modules, environment, capture_options)
        self._thread = threading.Thread(target=self._run, name="qforensics-writer", daemon=True)
        self._thread.start()

    # -- file layout -------------------------------------------------------------------------
    def _create(self, modules: list[dict[str, str]], environment: dict, options: dict) -> None:
        parent = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(parent, exist_ok=True)
        f = h5py.File(self.path, "w", libver="latest")
        f.attrs["format"] = schema.FORMAT_NAME
        f.attrs["format_version"] = schema.FORMAT_VERSION_STR
        f.attrs["writer"] = f"qforensics {__version__}"
        f.attrs["created_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        meta = f.create_group("meta")
        meta.attrs["environment"] = _json_attr(environment)
        meta.attrs["capture_options"] = _json_attr(options)
        # Reserve the attributes written at close: attribute creation is not allowed in SWMR mode.
        g = f.create_group("modules")
        str_t = h5py.string_dtype("utf-8")
        for col, _ in schema.MODULE_COLUMNS:
            data = [str(m.get(col, "")) for m in modules]
            g.create_dataset(col, data=np.array(data, dtype=object), dtype=str_t)
        self._cols: dict[str, h5py.Dataset] = {}
        for table, columns in (("steps", schema.STEP_COLUMNS), ("records", schema.RECORD_COLUMNS)):
            grp = f.create_group(table)
            for name, dt, shape in columns:
                self._cols[f"{table}/{name}"] = grp.create_dataset(
                    name, shape=(0, *shape), maxshape=(None, *shape), dtype=dt,
                    chunks=(_TABLE_CHUNKS[table], *shape), **_table_compression(dt),
                )
        snap = f.create_group("snapshots")
        for name, dt, shape in schema.SNAPSHOT_COLUMNS:
            self._cols[f"snapshots/index/{name}"] = snap.require_group("index").create_dataset(
                name, shape=(0,), maxshape=(None,), dtype=dt, chunks=(256,), **_COMPRESSION
            )
        inc = f.create_group("incidents")
        for name, dt, shape in schema.INCIDENT_COLUMNS:
            self._cols[f"incidents/{name}"] = inc.create_dataset(
                name, shape=(0,), maxshape=(None,), dtype=dt, chunks=(256,), **_COMPRESSION
            )
        eng = f.create_group("engine")
        for table, columns in schema.ENGINE_TABLES.items():
            for name, dt, shape in columns:
                self._cols[f"engine/{table}/{name}"] = eng.require_group(table).create_dataset(
                    name, shape=(0,), maxshape=(None,), dtype=dt, chunks=(1024,), **_COMPRESSION
                )
        for path, dt in schema.FLAT_ARRAYS.items():
            if path.startswith("channels/"):
                dt = self.channel_dtype.str
            # input ids grow by a token or a few per step and are compressed: small chunks,
            # since a flush recompresses the open one whole
            chunk = {"snapshots/data": 1 << 20, "tokens/input_ids": 4096}.get(path, 1 << 16)
            # Activation ranges are float noise: gzip saves ~14% of their bytes for ~35x the
            # CPU time, which the writer thread would take from the run. Store them raw.
            comp = {} if path in ("channels/min", "channels/max", "tokens/absmax") else (
                _COMPRESSION)
            self._cols[path] = f.create_dataset(
                path, shape=(0,), maxshape=(None,), dtype=dt, chunks=(chunk,), **comp
            )
        f["channels"].attrs["dtype"] = self.channel_dtype.name
        prom = f["channels"].create_group("promoted")
        for name, dt, _ in schema.PROMOTED_COLUMNS:
            self._cols[f"channels/promoted/{name}"] = prom.create_dataset(
                name, shape=(0,), maxshape=(None,), dtype=dt, chunks=(256,))
        trig = f.create_group("triggers")
        for name, dt, _ in schema.TRIGGER_COLUMNS:
            self._cols[f"triggers/{name}"] = trig.create_dataset(
                name, shape=(0,), maxshape=(None,), dtype=dt, chunks=(256,))
        k = max(self.ring_slots, 1)
        ring = f.create_group("ring")
        ring.attrs["slots"] = self.ring_slots
        for path in schema.RING_DATASETS:  # fixed K rows; the width is set by the first block
            # a slot is rewritten every K steps, whole: chunks sized to the expected block
            # (capture's hint) make that a few large writes instead of hundreds of small ones
            self._cols[path] = f.create_dataset(
                path, shape=(k, 0), maxshape=(k, None), dtype=self.channel_dtype,
                chunks=(1, self.ring_chunk))
        for path in schema.RING_INDEX:
            self._cols[path] = f.create_dataset(path, data=np.full(k, -1 if path.endswith(
                "step") else 0, np.int64))
        self._cols[schema.LIMITS_DATASET] = f.create_dataset(
            schema.LIMITS_DATASET, data=np.array([self.max_bytes, -1], np.int64))
        f.flush()
        f.swmr_mode = True
        self._file = f
        # lengths of the appendable datasets, kept here (h5py's .shape is a library call)
        self._len = {p: int(ds.shape[0]) for p, ds in self._cols.items()}
        self._geo: dict[str, tuple[int, int, tuple[int, ...]]] = {}

    # -- producer side -----------------------------------------------------------------------
    def submit(self, batch: StepBatch) -> None:
        if self._closed or self._failed:
            return
        self._items.append(batch)

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Block until every batch submitted before this call is written and flushed to disk (a
        barrier: no sleeping and hoping). False on timeout or when writing has failed."""
        if self._closed:
            return self._failed is None
        barrier = _Barrier()
        self._items.append(barrier)
        self._wake.set()
        return barrier.done.wait(timeout) and self._failed is None

    @property
    def failed(self) -> str | None:
        return self._failed

    # -- writer thread -----------------------------------------------------------------------
    def _run(self) -> None:
        pending: list[StepBatch] = []
        barriers: list[_Barrier] = []
        last_flush = time.monotonic()
        stop = False
        while not stop:
            # every step is on disk within about half the flush interval; each write costs
            # fixed h5py and flush work, so fewer writes cost the run less
            gap = max(0.01, self.flush_interval / 2)
            self._wake.wait(max(0.0, last_flush + gap - time.monotonic()))
            self._wake.clear()
            while self._items:  # take whatever is queued
                item = self._items.popleft()
                if item is None:
                    stop = True
                elif isinstance(item, _Barrier):
                    barriers.append(item)
                else:
                    pending.append(item)
            now = time.monotonic()
            if stop or barriers or now - last_flush >= gap:
                if pending:
                    self._write(pending)
                    pending = []
                last_flush = now
            for b in barriers:
                b.done.set()
            barriers = []

    def _write(self, batches: list[StepBatch]) -> None:
        if self._failed:
            return
        try:
            with self._lock:
                # one resize + write per dataset per flush, not per step: h5py's per-call
                # overhead (and the GIL it holds) is what a writer thread costs the run
                todo = []
                # a ring slot written twice in one go keeps only its last block
                last_in_slot = {}
                if self.ring_slots:
                    for i, b in enumerate(batches):
                        if b.ring and len(b.steps):
                            last_in_slot[int(b.steps["step"][0]) % self.ring_slots] = i
                for i, b in enumerate(batches):  # ring blocks: written in place, not appended
                    if b.ring:
                        if len(b.chan_min) and i in last_in_slot.values():
                            self._write_ring(b)
                        empty = np.zeros(0, self.channel_dtype)
                        b = replace(b, chan_min=empty, chan_max=empty, ring=False)
                    if self.capped_at is None:
                        todo.append(b)
                if todo:
                    merged = merge_batches(todo) if len(todo) > 1 else todo[0]
                    if self._fits(merged):
                        self._append_batch(merged)
                self._file.flush()
                self.steps_written += sum(len(b.steps) for b in batches)
        except Exception as exc:  # disk full, file removed, ...: degrade, never raise into the run
            self._failed = f"{type(exc).__name__}: {exc}"
            log.error("qforensics: trace writing stopped (%s); the run continues", self._failed)

    def _fits(self, b: StepBatch) -> bool:
        """False (and the cap noted in /limits) when appending `b` could pass max_bytes."""
        if not self.max_bytes:
            return True
        n_chan = len(b.chan_min) + sum(len(p[1]) for p in b.promote)
        grow = [("channels/min", n_chan), ("channels/max", n_chan),
                ("tokens/absmax", len(b.tok_absmax)), ("tokens/input_ids", len(b.input_ids)),
                ("snapshots/data", len(b.snapshot_bytes))]
        for table, columns, n in (("steps", schema.STEP_COLUMNS, len(b.steps)),
                                  ("records", schema.RECORD_COLUMNS, len(b.records)),
                                  ("snapshots/index", schema.SNAPSHOT_COLUMNS, len(b.snapshots)),
                                  ("incidents", schema.INCIDENT_COLUMNS, len(b.incidents)),
                                  ("triggers", schema.TRIGGER_COLUMNS, len(b.triggers)),
                                  ("channels/promoted", schema.PROMOTED_COLUMNS,
                                   len(b.promote))):
            grow += [(f"{table}/{name}", n) for name, _, _ in columns]
        if self._within_cap(sum(self._chunk_growth(p, n) for p, n in grow)):
            return True
        self._reach_cap(int(b.steps["step"][0]) if len(b.steps) else -1)
        return False

    def _chunk_growth(self, path: str, n: int) -> int:
        """Upper bound of the bytes appending n rows to a dataset allocates: whole chunks,
        uncompressed (compression only shrinks them)."""
        if n <= 0:
            return 0
        c, row, _ = self._geometry(path)
        have = self._len[path]
        return (-(-(have + n) // c) - -(-have // c)) * c * row

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
        # 64 KiB for HDF5's own metadata (B-tree nodes, heaps) that a flush may add
        return not self.max_bytes or os.path.getsize(self.path) + extra + (64 << 10) <= (
            self.max_bytes)

    def _reach_cap(self, first: int) -> None:
        self.capped_at = first
        self._cols[schema.LIMITS_DATASET][1] = first
        log.warning("qforensics: trace reached max_bytes=%d at step %d; appending stops, the "
                    "ring of the last steps keeps turning", self.max_bytes, first)

    def _write_ring(self, b: StepBatch) -> None:
        """The step's channel block into slot step % K of the fixed-size circular region."""
        if not self.ring_slots or not len(b.steps):
            return
        step = int(b.steps["step"][0])
        slot = step % self.ring_slots
        n = len(b.chan_min)
        dmin, dmax = self._cols["ring/min"], self._cols["ring/max"]
        if n > dmin.shape[1]:
            width = -(-n // 4096) * 4096
            if self.capped_at is not None or not self._within_cap(
                    2 * dmin.shape[0] * (width - dmin.shape[1]) * dmin.dtype.itemsize):
                if self.capped_at is None:
                    self._reach_cap(step)
                return
            dmin.resize((dmin.shape[0], width))
            dmax.resize((dmax.shape[0], width))
        _put(self._cols["ring/step"], slot, -1)  # invalid while the slot is rewritten
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
        _put(self._cols["ring/count"], slot, n)
        _put(self._cols["ring/step"], slot, step)

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
        _rebase_channels(rec, chan_base)
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
        self._wake.set()
        self._thread.join(timeout=60)
        try:
            with self._lock:
                self._file.close()
        except Exception as exc:
            log.error("qforensics: closing the trace failed: %s", exc)
            return
        st = dict(status or {})
        st.setdefault("state", "complete")
        st["steps_written"] = self.steps_written
        if self.capped_at is not None:
            st["max_bytes_reached"] = {"max_bytes": self.max_bytes, "step": self.capped_at}
        if self._failed:
            st["writer_error"] = self._failed
        try:
            set_meta(self.path, "status", st)
        except Exception as exc:
            log.error("qforensics: could not write the trace status: %s", exc)


def set_meta(path: str | os.PathLike[str], key: str, value: Any) -> None:
    """Write one JSON metadata attribute (e.g. a scenario's outcome) into a closed trace."""
    if key not in schema.META_KEYS:
        raise ValueError(f"unknown meta key {key!r}; known: {', '.join(schema.META_KEYS)}")
    with h5py.File(os.fspath(path), "a") as f:
        f["meta"].attrs[key] = _json_attr(value)


def compact_trace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Copy a closed trace into a fresh file without the free space that appends leave behind
    (and without SWMR flags), e.g. before committing or mailing it."""
    src, dst = os.fspath(src), os.fspath(dst)
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError("compact_trace needs a different destination path")
    with h5py.File(src, "r") as fin, h5py.File(dst, "w") as fout:
        for k, v in fin.attrs.items():
            fout.attrs[k] = v
        for name in fin:
            fin.copy(fin[name], fout, name=name)
