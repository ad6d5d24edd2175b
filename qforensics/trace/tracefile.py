"""Opening a trace and checking its structure: the base of `Trace` (trace/reader.py).

Trace files are untrusted input. On open, the format name and version are checked (a newer
major version is refused), links, virtual datasets and external storage are refused anywhere in
the file (trace/validate.py), every table column's dtype and trailing shape is checked, and the
ring index is validated. Reads go through `_read_table` (bounds-checked, guarded); each h5py
dataset is looked up once per open file. No torch import.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Self

import h5py
import numpy as np

from qforensics.errors import TraceFormatError, TraceUnreadableError, TraceVersionError
from qforensics.trace import schema
from qforensics.trace.ring import RingIndex
from qforensics.trace.table import Table
from qforensics.trace.validate import check_self_contained, open_hdf5, read, read_prefix

__all__ = ["TraceFile"]

log = logging.getLogger("qforensics.trace.reader")

UNREADABLE_ERRORS = (OSError, RuntimeError)


def _attr_text(raw: Any) -> Any:
    if isinstance(raw, bytes):
        return raw.decode("utf-8", "replace")
    return raw


def _get(f: h5py.File, path: str) -> Any:
    try:
        return f.get(path)
    except UNREADABLE_ERRORS:
        return None


class _NoRing(dict):
    """Stands for a file whose ring could not be read: no /ring, no promoted blocks."""


def frozen_view(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False  # shared by every caller: a write would be a bug, so it raises
    return a


class TraceFile:
    """An open, structurally validated trace file (see `Trace` for the views)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._objs: dict[str, h5py.Dataset] = {}  # path -> dataset, looked up once
        self._rec_cols: dict[str, np.ndarray] = {}  # whole-trace record columns (read-only)
        self._rec_tables: dict[tuple[int, int], Table] = {}
        self._f, self.cut_short = open_hdf5(self.path, "trace")
        # what could not be read (damaged chunks, a cut-short file), in words; never PASSED
        self.unreadable: list[str] = [self.cut_short] if self.cut_short else []
        try:
            self._validate()
        except TraceFormatError:
            self.close()
            raise
        except (KeyError, ValueError, TypeError, OverflowError, *UNREADABLE_ERRORS) as exc:
            self.close()
            raise TraceFormatError(f"{self.path}: malformed trace ({exc})") from None

    # -- validation --------------------------------------------------------------------------
    def _validate(self) -> None:
        f, p = self._f, self.path
        name = _attr_text(f.attrs.get("format"))
        if name != schema.FORMAT_NAME:
            raise TraceFormatError(f"{p}: not a qforensics trace (root attribute format={name!r})")
        ver = _attr_text(f.attrs.get("format_version"))
        try:
            major, minor = (int(x) for x in str(ver).split("."))
        except ValueError:
            raise TraceFormatError(f"{p}: bad format_version {ver!r}") from None
        if major > schema.FORMAT_VERSION[0]:
            raise TraceVersionError(
                f"{p}: trace format {major}.{minor} is newer than this qforensics reads "
                f"({schema.FORMAT_VERSION_STR}); upgrade qforensics (pip install -U qforensics)"
            )
        if major == schema.FORMAT_VERSION[0] and minor > schema.FORMAT_VERSION[1]:
            log.warning("%s: trace format %s.%s is newer than %s; reading what is known",
                        p, major, minor, schema.FORMAT_VERSION_STR)
        self.format_version = (major, minor)
        lost = check_self_contained(f, p, found=self._objs)
        self._lost = {x.lstrip("/") for x in lost}
        if lost:
            self.unreadable.append("unreadable objects: " + ", ".join(lost[:6])
                                   + (f" and {len(lost) - 6} more" if len(lost) > 6 else ""))
        if "" in self._lost:
            raise TraceUnreadableError(f"{p}: {self.cut_short or 'the file is damaged'}: its root "
                                       "group cannot be read, so nothing in it can be")
        if "meta" not in self._lost and not isinstance(_get(f, "meta"), h5py.Group):
            raise TraceFormatError(f"{p}: no /meta group (every qforensics writer creates it "
                                   "first): the file is damaged or not a trace")
        self._lengths: dict[str, int] = {}
        for table, columns in (("steps", schema.STEP_COLUMNS), ("records", schema.RECORD_COLUMNS),
                               ("snapshots/index", schema.SNAPSHOT_COLUMNS)):
            self._lengths[table] = self._check_table(table, columns)
        if any(c == "steps" or c.startswith("steps/") for c in self._lost):
            raise TraceUnreadableError(f"{p}: {self.cut_short or 'the file is damaged'}: the "
                                       "/steps table cannot be read, so no step can be analyzed")
        # /incidents arrived in format 1.0 from the start; tolerate its absence (minor versions)
        self._has_incidents = isinstance(_get(f, "incidents"), h5py.Group)
        if self._has_incidents:
            self._lengths["incidents"] = self._check_table("incidents", schema.INCIDENT_COLUMNS)
        # /engine arrived in a 1.0 minor revision: tolerate its absence
        self._engine_tables = [t for t in schema.ENGINE_TABLES
                               if isinstance(self._f.get(f"engine/{t}"), h5py.Group)]
        for t in self._engine_tables:
            self._lengths[f"engine/{t}"] = self._check_table(f"engine/{t}",
                                                             schema.ENGINE_TABLES[t])
        for path, dt in schema.FLAT_ARRAYS.items():
            ds = self._dataset(path)
            if ds is None:
                self._lengths[path] = 0
                continue
            if ds.ndim != 1:
                raise TraceFormatError(f"{p}: /{path} must be 1-D")
            kind = np.dtype(dt).kind
            if ds.dtype.kind != kind:
                raise TraceFormatError(f"{p}: /{path} has dtype {ds.dtype}, expected kind {kind}")
            self._lengths[path] = ds.shape[0]
        n_mod = set()
        for col, _ in schema.MODULE_COLUMNS:
            ds = self._dataset(f"modules/{col}")
            if ds is None:
                n_mod.add(0)
                continue
            if ds.dtype.kind not in "OS" or ds.ndim != 1:
                raise TraceFormatError(f"{p}: /modules/{col} must hold strings")
            n_mod.add(ds.shape[0])
        if len(n_mod) != 1:
            raise TraceFormatError(f"{p}: /modules columns differ in length")
        self.n_modules = n_mod.pop()
        n_flat = min(self._lengths.get("channels/min", 0), self._lengths.get("channels/max", 0))
        try:  # format 1.1: ring-relative channel offsets (trace/ring.py)
            self._ring = RingIndex(f, p, n_flat)
        except UNREADABLE_ERRORS as exc:
            self.unreadable.append(f"/ring and /channels/promoted ({exc})")
            self._ring = RingIndex(_NoRing(), p, n_flat)

    def _dataset(self, path: str) -> h5py.Dataset | None:
        """The dataset at `path`; None (and noted unreadable) when a damaged or cut-short file
        lost it; TraceFormatError when it is simply not there."""
        obj = self._objs.get(path)
        if obj is not None:
            return obj
        if any(path == x or path.startswith(x + "/") for x in self._lost):
            return None
        try:
            obj = self._f.get(path)
        except UNREADABLE_ERRORS as exc:
            self.unreadable.append(f"/{path} ({exc})")
            self._lost.add(path)
            return None
        if not isinstance(obj, h5py.Dataset):
            raise TraceFormatError(f"{self.path}: missing dataset /{path}")
        self._objs[path] = obj
        return obj

    def _check_table(self, table: str, columns: list) -> int:
        n = None
        for name, dt, shape in columns:
            ds = self._dataset(f"{table}/{name}")
            if ds is None:
                n = 0
                continue
            want = np.dtype(dt)
            # each h5py property asks the library again: ask once (validation runs per trace)
            kind, have = ds.dtype.kind, ds.shape
            ok = kind == want.kind or (want.kind in "iu" and kind in "iu")
            if not ok or tuple(have[1:]) != tuple(shape) or len(have) != 1 + len(shape):
                raise TraceFormatError(
                    f"{self.path}: /{table}/{name} has dtype {ds.dtype} shape {have}, "
                    f"expected {want} with trailing shape {shape}"
                )
            n = have[0] if n is None else min(n, have[0])  # killed mid-append: shortest
        return int(n or 0)

    # -- plumbing ----------------------------------------------------------------------------
    def close(self) -> None:
        try:
            self._f.close()
        except UNREADABLE_ERRORS:  # closing a damaged file must not mask the real error
            pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read_table(self, table: str, columns: list, start: int = 0, stop: int | None = None,
                    fields: list[str] | None = None) -> dict[str, np.ndarray]:
        n = self._lengths[table]
        stop = n if stop is None else max(start, min(stop, n))
        out = {}
        for name, dt, shape in columns:
            if fields is not None and name not in fields:
                continue
            ds = self._dataset(f"{table}/{name}")
            if ds is None:
                if stop > start:
                    raise TraceUnreadableError(f"{self.path}: /{table}/{name} is unreadable")
                out[name] = np.zeros((0, *shape), dtype=np.dtype(dt))
                continue
            out[name] = read(ds, slice(start, stop), self.path)
        if table == "records" and "chan_offset" in out and len(out["chan_offset"]):
            need = {k: out[k] if k in out else
                    self._read_table("records", schema.RECORD_COLUMNS, start, stop, [k])[k]
                    for k in ("flags", "step", "channels")}
            out["chan_offset"] = self._ring.resolve(out["chan_offset"], need["flags"], need["step"],
                                                    need["channels"])
        return out

    def _record_slice(self, start: int, stop: int, fields: list[str]) -> dict[str, np.ndarray]:
        """Record columns over rows [start, stop): slices of the kept whole-trace columns where
        they cover the rows, read from the file otherwise."""
        out: dict[str, np.ndarray] = {}
        missing = []
        for k in fields:
            kept = self._rec_cols.get(k)
            if kept is not None and stop <= len(kept):
                out[k] = kept[start:stop]
            else:
                missing.append(k)
        if missing:
            out.update(self._read_table("records", schema.RECORD_COLUMNS, start, stop, missing))
        return out

    def _records_limit(self) -> int:
        """Rows in /records; when a damaged file lost the table, the int64 maximum (the spans
        are then checked for sanity only, and every read of them is refused as unreadable)."""
        if any(c == "records" or c.startswith("records/") for c in self._lost):
            return int(np.iinfo(np.int64).max)
        return self._lengths["records"]

    def _read_prefix_table(self, table: str, columns: list, stop: int | None = None
                           ) -> tuple[dict[str, np.ndarray], int | None]:
        n = self._lengths[table] if stop is None else min(stop, self._lengths[table])
        out: dict[str, np.ndarray] = {}
        first_bad: int | None = None
        for name, dt, shape in columns:
            ds = self._dataset(f"{table}/{name}")
            if ds is None:
                out[name], bad = np.zeros((0, *shape), dtype=np.dtype(dt)), 0
            else:
                out[name], bad = read_prefix(ds, 0, n)
            if bad is not None:
                first_bad = bad if first_bad is None else min(first_bad, bad)
        m = min((len(v) for v in out.values()), default=0)
        return {k: v[:m] for k, v in out.items()}, first_bad

    def _ds(self, path: str) -> h5py.Dataset:
        ds = self._dataset(path)
        if ds is None:
            raise TraceUnreadableError(f"{self.path}: /{path} is unreadable")
        return ds

