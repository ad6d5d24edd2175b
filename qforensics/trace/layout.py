"""The trace file's layout as the writer creates it, and edits of a closed trace.

`create_file` makes every group and appendable dataset of docs/trace-format.md (chunking and
compression chosen for a writer that flushes every second), the root attributes and /meta with
the status slot reserved at its final size; trace/writer.py adds the budget's datasets, turns
SWMR on and owns the file from then on. `set_meta` and `compact_trace` work on closed traces.
Nothing here imports torch.
"""

from __future__ import annotations

import os
import time
from typing import Any

import h5py
import numpy as np

from qforensics.errors import CaptureError
from qforensics.jsondoc import dumps
from qforensics.trace import schema, validate
from qforensics.version import __version__

__all__ = ["STATUS_BYTES", "compact_trace", "create_file", "json_attr", "set_meta"]

# gzip level 1: a flush recompresses every open chunk of ~45 integer columns; level 4 took
# twice the CPU for files within 0.1% of the size (bench/writer_cost.py)
_COMPRESSION = {"compression": "gzip", "compression_opts": 1, "shuffle": True}


# rows per chunk: a flush recompresses each open chunk whole, so the one-row-per-step table
# gets small chunks
_TABLE_CHUNKS = {"steps": 256, "records": 2048}


# /meta@status is reserved at this size (JSON padded with spaces) and sealed in place
STATUS_BYTES = 16384
UNSEALED = b"{}"  # what the slot holds until close: no "state", so the reader says truncated


def _table_compression(dt: Any) -> dict[str, Any]:
    """Per-step table columns: integer columns (indices, counts, offsets) shrink several-fold
    under gzip for little CPU; float statistics are noise that gzip barely shrinks, while every
    flush would recompress their open chunk (the writer thread's largest cost). Stored raw."""
    return {} if np.dtype(dt).kind == "f" else _COMPRESSION


def json_attr(obj: Any) -> str:
    """A JSON attribute or cell of a trace, under jsondoc's one non-finite policy: NaN and
    Infinity are written as the strings "nan", "inf", "-inf" (`validate.parse_json` reads them
    back as floats), never as bare constants."""
    return dumps(obj, indent=None, sort_keys=True)


def create_file(path: str, modules: list[dict[str, str]], environment: dict, options: dict,
                *, channel_dtype: np.dtype, ring_slots: int, ring_chunk: int, max_bytes: int
                ) -> tuple[h5py.File, dict[str, h5py.Dataset]]:
    """Create the trace file with every group and dataset the writer appends to, its
    attributes and reserved status slot; the file and its datasets by path. Not yet in SWMR
    mode: the writer adds the budget's datasets first (trace/budget.py)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    kind = validate.non_regular_kind(path)
    if kind is not None:  # opening a FIFO for writing blocks until someone reads it
        raise CaptureError(f"{path}: is {kind}, not a trace file; give -o a file path")
    f = h5py.File(path, "w", libver="latest")
    f.attrs["format"] = schema.FORMAT_NAME
    f.attrs["format_version"] = schema.FORMAT_VERSION_STR
    f.attrs["writer"] = f"qforensics {__version__}"
    f.attrs["created_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    meta = f.create_group("meta")
    meta.attrs["environment"] = json_attr(environment)
    meta.attrs["capture_options"] = json_attr(options)
    # /meta@status, reserved at its final size: close writes it in place while the file is
    # still in SWMR mode (attribute creation is not allowed there), so no moment of the
    # seal leaves the file open for non-SWMR writing, which a kill would make unopenable
    meta.attrs.create("status", np.bytes_(UNSEALED.ljust(STATUS_BYTES)),
                      dtype=f"S{STATUS_BYTES}")
    # Reserve the attributes written at close: attribute creation is not allowed in SWMR mode.
    g = f.create_group("modules")
    str_t = h5py.string_dtype("utf-8")
    for col, _ in schema.MODULE_COLUMNS:
        data = [str(m.get(col, "")) for m in modules]
        g.create_dataset(col, data=np.array(data, dtype=object), dtype=str_t)
    cols: dict[str, h5py.Dataset] = {}
    for table, columns in (("steps", schema.STEP_COLUMNS), ("records", schema.RECORD_COLUMNS)):
        grp = f.create_group(table)
        for name, dt, shape in columns:
            cols[f"{table}/{name}"] = grp.create_dataset(
                name, shape=(0, *shape), maxshape=(None, *shape), dtype=dt,
                chunks=(_TABLE_CHUNKS[table], *shape), **_table_compression(dt),
            )
    snap = f.create_group("snapshots")
    for name, dt, shape in schema.SNAPSHOT_COLUMNS:
        cols[f"snapshots/index/{name}"] = snap.require_group("index").create_dataset(
            name, shape=(0,), maxshape=(None,), dtype=dt, chunks=(256,), **_COMPRESSION
        )
    inc = f.create_group("incidents")
    for name, dt, shape in schema.INCIDENT_COLUMNS:
        cols[f"incidents/{name}"] = inc.create_dataset(
            name, shape=(0,), maxshape=(None,), dtype=dt, chunks=(256,), **_COMPRESSION
        )
    eng = f.create_group("engine")
    for table, columns in schema.ENGINE_TABLES.items():
        for name, dt, shape in columns:
            cols[f"engine/{table}/{name}"] = eng.require_group(table).create_dataset(
                name, shape=(0,), maxshape=(None,), dtype=dt, chunks=(1024,), **_COMPRESSION
            )
    for path, dt in schema.FLAT_ARRAYS.items():
        if path.startswith("channels/"):
            dt = channel_dtype.str
        # input ids grow by a token or a few per step and are compressed: small chunks,
        # since a flush recompresses the open one whole
        chunk = {"snapshots/data": 1 << 20, "tokens/input_ids": 4096}.get(path, 1 << 16)
        # Activation ranges are float noise: gzip saves ~14% of their bytes for ~35x the
        # CPU time, which the writer thread would take from the run. Store them raw.
        comp = {} if path in ("channels/min", "channels/max", "tokens/absmax") else (
            _COMPRESSION)
        cols[path] = f.create_dataset(
            path, shape=(0,), maxshape=(None,), dtype=dt, chunks=(chunk,), **comp
        )
    f["channels"].attrs["dtype"] = channel_dtype.name
    prom = f["channels"].create_group("promoted")
    for name, dt, _ in schema.PROMOTED_COLUMNS:
        cols[f"channels/promoted/{name}"] = prom.create_dataset(
            name, shape=(0,), maxshape=(None,), dtype=dt, chunks=(256,))
    watch = f.create_group("param_watch")  # a few rows at most: one per corrupt tensor
    for name, dt, shape in schema.PARAM_WATCH_COLUMNS:
        cols[f"param_watch/{name}"] = watch.create_dataset(
            name, shape=(0, *shape), maxshape=(None, *shape), dtype=dt, chunks=(16, *shape))
    trig = f.create_group("triggers")
    for name, dt, _ in schema.TRIGGER_COLUMNS:
        cols[f"triggers/{name}"] = trig.create_dataset(
            name, shape=(0,), maxshape=(None,), dtype=dt, chunks=(256,))
    k = max(ring_slots, 1)
    ring = f.create_group("ring")
    ring.attrs["slots"] = ring_slots
    for path in schema.RING_DATASETS:  # fixed K rows; the width is set by the first block
        # a slot is rewritten every K steps, whole: chunks sized to the expected block
        # (capture's hint) make that a few large writes instead of hundreds of small ones
        cols[path] = f.create_dataset(
            path, shape=(k, 0), maxshape=(k, None), dtype=channel_dtype,
            chunks=(1, ring_chunk))
    for path in schema.RING_INDEX:
        cols[path] = f.create_dataset(path, data=np.full(k, -1 if path.endswith(
            "step") else 0, np.int64))
    cols[schema.STATUS_RAW] = f.create_dataset(schema.STATUS_RAW,
                                               data=np.zeros(STATUS_BYTES, np.uint8))
    cols[schema.HITS_CHECKED] = f.create_dataset(schema.HITS_CHECKED, data=np.zeros(3, np.int64))
    cols[schema.LIMITS_DATASET] = f.create_dataset(
        schema.LIMITS_DATASET, data=np.array([max_bytes, -1], np.int64))
    return f, cols


def set_meta(path: str | os.PathLike[str], key: str, value: Any) -> None:
    """Write one JSON metadata attribute (e.g. a scenario's outcome) into a closed trace."""
    if key not in schema.META_KEYS:
        raise ValueError(f"unknown meta key {key!r}; known: {', '.join(schema.META_KEYS)}")
    with h5py.File(os.fspath(path), "a") as f:
        f["meta"].attrs[key] = json_attr(value)


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
