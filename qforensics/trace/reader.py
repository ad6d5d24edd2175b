"""Validating trace reader: numpy and pandas views of a qforensics HDF5 trace.

Trace files are untrusted input. The checks live in trace/validate.py: the reader checks the
format name and version (refusing a newer major version), refuses links, virtual datasets and
external storage, checks every column's dtype and every offset against the arrays it points into
(with Python ints), guards every data read, and never unpickles anything. A trace left behind by a
crashed or killed run (SWMR flags still set, columns of unequal length, a file cut short) is
opened as far as it goes and says where it ends; what could not be read is listed in
`Trace.unreadable`, and the analysis never calls such a trace PASSED. No torch import.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterator

import h5py
import numpy as np
import pandas as pd

from qforensics.errors import TraceFormatError, TraceUnreadableError, TraceVersionError
from qforensics.formats import MODULE_KINDS
from qforensics.trace import schema
from qforensics.trace.blocks import ChannelAccess
from qforensics.trace.snapshots import SnapshotAccess
from qforensics.trace.validate import (
    check_self_contained,
    checked_span,
    open_hdf5,
    parse_json,
    read,
    read_prefix,
    valid_spans,
)
from qforensics.trace.ring import RingIndex

log = logging.getLogger(__name__)

_UNREADABLE = (OSError, RuntimeError)


@dataclass(frozen=True)
class TraceEnd:
    complete: bool  # the writer closed the file
    last_step: int  # -1 when no step was written
    reason: str  # human sentence: how and where the trace ends


_HEALTH = ("nan_count", "inf_count")  # record columns every verdict depends on
_STEP_DOMAINS = (  # (column, lowest, highest or None)
    ("n_nonfinite_records", 0, None), ("logits_nan", 0, None), ("logits_inf", 0, None),
    ("n_calls", 0, None), ("record_count", 0, None), ("token_count", 0, None),
    ("first_nonfinite_call", -1, None), ("first_nonfinite_record", -1, None),
    ("complete", 0, 1), ("has_logits", 0, 1),
)


def _span_end(steps: dict[str, np.ndarray]) -> int:
    """max(offset + count) over step rows already checked by valid_spans (no wrap)."""
    if not len(steps["record_offset"]):
        return 0
    return int((steps["record_offset"] + steps["record_count"]).max())


def _parse_json(raw: Any, where: str) -> Any:
    return parse_json(raw, where)


def _attr_text(raw: Any) -> Any:
    if isinstance(raw, bytes):
        return raw.decode("utf-8", "replace")
    return raw


def _get(f: h5py.File, path: str) -> Any:
    try:
        return f.get(path)
    except _UNREADABLE:
        return None


class _NoRing(dict):
    """Stands for a file whose ring could not be read: no /ring, no promoted blocks."""


class Trace(ChannelAccess, SnapshotAccess):
    """An open trace. Use as a context manager or call `close()`.

    `meta` is a dict; `modules`, `steps`, `records()` and `snapshots` are pandas DataFrames;
    per-channel and per-token arrays come from `channel_ranges` and `token_absmax`.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._f, self.cut_short = open_hdf5(self.path, "trace")
        # what could not be read (damaged chunks, a cut-short file), in words; never PASSED
        self.unreadable: list[str] = [self.cut_short] if self.cut_short else []
        try:
            self._validate()
        except TraceFormatError:
            self.close()
            raise
        except (KeyError, ValueError, TypeError, OverflowError, *_UNREADABLE) as exc:
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
        lost = check_self_contained(f, p)
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
        except _UNREADABLE as exc:
            self.unreadable.append(f"/ring and /channels/promoted ({exc})")
            self._ring = RingIndex(_NoRing(), p, n_flat)

    def _dataset(self, path: str) -> h5py.Dataset | None:
        """The dataset at `path`; None (and noted unreadable) when a damaged or cut-short file
        lost it; TraceFormatError when it is simply not there."""
        if any(path == x or path.startswith(x + "/") for x in self._lost):
            return None
        try:
            obj = self._f.get(path)
        except _UNREADABLE as exc:
            self.unreadable.append(f"/{path} ({exc})")
            self._lost.add(path)
            return None
        if not isinstance(obj, h5py.Dataset):
            raise TraceFormatError(f"{self.path}: missing dataset /{path}")
        return obj

    def _check_table(self, table: str, columns: list) -> int:
        n = None
        for name, dt, shape in columns:
            ds = self._dataset(f"{table}/{name}")
            if ds is None:
                n = 0
                continue
            want = np.dtype(dt)
            ok = ds.dtype.kind == want.kind or (want.kind in "iu" and ds.dtype.kind in "iu")
            if not ok or tuple(ds.shape[1:]) != tuple(shape) or ds.ndim != 1 + len(shape):
                raise TraceFormatError(
                    f"{self.path}: /{table}/{name} has dtype {ds.dtype} shape {ds.shape}, "
                    f"expected {want} with trailing shape {shape}"
                )
            n = ds.shape[0] if n is None else min(n, ds.shape[0])  # killed mid-append: shortest
        return int(n or 0)

    # -- plumbing ----------------------------------------------------------------------------
    def close(self) -> None:
        try:
            self._f.close()
        except _UNREADABLE:  # closing a damaged file must not mask the real error
            pass

    def __enter__(self) -> "Trace":
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

    # -- metadata ----------------------------------------------------------------------------
    @cached_property
    def meta(self) -> dict[str, Any]:
        """environment, capture_options, status (absent: writer never closed), outcome."""
        out: dict[str, Any] = {}
        if "meta" in self._lost:
            return out
        try:
            g = self._f.get("meta")
            keys = [k for k in schema.META_KEYS if k in g.attrs]
            raws = {k: g.attrs[k] for k in keys}
        except _UNREADABLE as exc:
            self.unreadable.append(f"/meta attributes ({exc})")
            return out
        for key, raw in raws.items():
            out[key] = _parse_json(raw, f"{self.path}: /meta@{key}")
        if "environment" not in out:
            self.unreadable.append("/meta@environment is missing (every writer stores it)")
        return out

    @cached_property
    def modules(self) -> pd.DataFrame:
        cols = {}
        for col, _ in schema.MODULE_COLUMNS:
            ds = self._dataset(f"modules/{col}")
            if ds is None:
                raise TraceUnreadableError(f"{self.path}: /modules/{col} is unreadable")
            vals = read(ds, slice(None), self.path)
            cols[col] = [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
                         for v in vals]
        df = pd.DataFrame(cols)
        df.index.name = "module_id"
        odd = ~df["kind"].isin(MODULE_KINDS)
        if odd.any():
            i = int(np.argmax(odd.to_numpy()))
            self.unreadable.append(f"/modules/kind[{i}] is {df['kind'].iloc[i]!r:.40}, not a "
                                   f"module kind ({', '.join(sorted(MODULE_KINDS))})")
        return df

    def module_info(self, module_id: int) -> dict[str, Any]:
        raw = self.modules["info"].iloc[int(module_id)]
        return _parse_json(raw, f"{self.path}: /modules/info[{module_id}]") if raw else {}

    def module_name(self, module_id: int) -> str:
        if 0 <= int(module_id) < self.n_modules:
            return self.modules["name"].iloc[int(module_id)] or "(model output)"
        return f"<unknown module {module_id}>"

    # -- steps -------------------------------------------------------------------------------
    @cached_property
    def _step_arrays(self) -> dict[str, np.ndarray]:
        """The /steps table as far as it is readable, cut at the first row whose records,
        tokens or record health (NaN/Inf counts) cannot be read or point past the data."""
        raw, bad_row = self._read_prefix_table("steps", schema.STEP_COLUMNS)
        if bad_row is not None:
            self.unreadable.append(f"/steps rows from {bad_row} on")
        # a lost /records keeps the summaries usable; their spans are checked for sanity only
        self._check_step_domains(raw)
        n_rec = self._records_limit()
        ok = valid_spans(raw["record_offset"], raw["record_count"], n_rec)
        ok &= valid_spans(raw["token_offset"], raw["token_count"],
                          self._lengths["tokens/input_ids"])
        if not ok.all():
            cut = int(np.argmin(ok))
            self.unreadable.append(f"/steps rows from {cut} on point past the data they index")
            raw = {k: v[:cut] for k, v in raw.items()}
        n = len(raw["step"])
        end = _span_end(raw)
        # every record column is read (and decompressed) once, so damage anywhere in /records
        # is seen; the NaN/Inf counts are kept for the cross-check with the summaries
        table, bad_rec = self._read_prefix_table("records", schema.RECORD_COLUMNS, stop=end)
        health = {k: table[k] for k in _HEALTH}
        del table
        self._health = health
        self.records_readable = len(health["nan_count"]) if bad_rec is None else bad_rec
        if bad_rec is not None:
            keep = (raw["record_offset"] + raw["record_count"]) <= bad_rec  # both >= 0 here
            cut = int(np.argmin(keep)) if not keep.all() else n
            self.unreadable.append(f"/records rows from {bad_rec} on (the records of step rows "
                                   f"from {cut} on; their per-step summaries remain)")
        neg = (health["nan_count"] < 0) | (health["inf_count"] < 0)
        if neg.any():
            self.unreadable.append(f"/records row {int(np.argmax(neg))} has a negative NaN/Inf "
                                   "count")
        return raw

    def _check_step_domains(self, raw: dict[str, np.ndarray]) -> None:
        """Counts are >= 0, 'first' indices are -1 (none) or >= 0, flags are 0 or 1: a value
        outside its domain is damage the format itself can show."""
        for col, lo, hi in _STEP_DOMAINS:
            v = raw[col]
            bad = (v < lo) | (v > hi) if hi is not None else (v < lo)
            if bad.any():
                i = int(np.argmax(bad))
                self.unreadable.append(f"/steps/{col}[{i}] holds {v[i]}, outside its domain")

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

    def nonfinite_record_steps(self) -> np.ndarray:
        """Steps (sorted, unique) holding any record with NaN or Inf, from a scan of every
        record's counts (independent of the per-step summaries)."""
        steps = self._step_arrays
        h = self._health
        end = min(self.records_end, len(h["nan_count"]))
        bad = (h["nan_count"][:end] > 0) | (h["inf_count"][:end] > 0)
        if not bad.any():
            return np.zeros(0, dtype=np.int64)
        rows = np.nonzero(bad)[0]
        idx = np.searchsorted(steps["record_offset"], rows, side="right") - 1
        return np.unique(steps["step"][idx[idx >= 0]].astype(np.int64))

    @cached_property
    def steps(self) -> pd.DataFrame:
        raw = self._step_arrays
        cols = {k: v for k, v in raw.items() if v.ndim == 1}
        df = pd.DataFrame(cols)
        df["logits_top5_ids"] = list(raw["logits_top5_ids"])
        df["logits_top5_values"] = list(raw["logits_top5_values"])
        return df

    @property
    def n_steps(self) -> int:
        return len(self._step_arrays["step"])

    def step_row(self, step: int) -> int:
        idx = np.nonzero(self._step_arrays["step"] == step)[0]
        if len(idx) == 0:
            raise TraceFormatError(f"{self.path}: no step {step} in this trace "
                                   f"({self.n_steps} steps recorded)")
        return int(idx[0])

    def input_ids(self, step: int) -> np.ndarray:
        r = self.step_row(step)
        lo, hi = checked_span(self._step_arrays["token_offset"][r],
                              self._step_arrays["token_count"][r],
                              self._lengths["tokens/input_ids"], f"{self.path}: step {step} tokens")
        return read(self._ds("tokens/input_ids"), slice(lo, hi), self.path)

    def _ds(self, path: str) -> h5py.Dataset:
        ds = self._dataset(path)
        if ds is None:
            raise TraceUnreadableError(f"{self.path}: /{path} is unreadable")
        return ds

    @cached_property
    def end(self) -> TraceEnd:
        status = self.meta.get("status")
        n = self.n_steps
        last = int(self._step_arrays["step"][-1]) if n else -1
        if self.cut_short:
            return TraceEnd(False, last, f"{self.cut_short}; the readable part ends after step "
                            f"{last} ({n} steps)")
        if isinstance(status, dict) and status.get("state"):
            state = str(status.get("state"))
            if state == "complete":
                return TraceEnd(True, last, f"complete: {n} steps")
            return TraceEnd(True, last, f"run ended with {state}: "
                            f"{status.get('error', '')}".rstrip(": "))
        orphan = self._lengths["records"] - self.records_end
        return TraceEnd(False, last, "truncated: the writer never closed the file (the run "
                        f"crashed or was killed); trace ends after step {last}"
                        + (f", {orphan} records of a later step are incomplete" if orphan else ""))

    # -- records -----------------------------------------------------------------------------
    def records(self, step: int | None = None, *, start: int | None = None,
                stop: int | None = None) -> pd.DataFrame:
        """Records of one step (or a row range, or everything), with a `row` column."""
        if step is not None:
            r = self.step_row(step)
            start, stop = checked_span(self._step_arrays["record_offset"][r],
                                       self._step_arrays["record_count"][r],
                                       self._records_limit(), f"{self.path}: step {step}")
        start = 0 if start is None else int(start)
        if stop is None:
            stop = self.records_end
        if int(stop) > self.records_readable:
            raise TraceUnreadableError(f"{self.path}: /records rows [{start}, {stop}) could not "
                                       f"be read (readable up to row {self.records_readable})")
        data = self._read_table("records", schema.RECORD_COLUMNS, start, stop)
        df = pd.DataFrame(data)
        df.insert(0, "row", np.arange(start, start + len(df), dtype=np.int64))
        mod = df["module_id"].to_numpy()
        if len(mod) and (mod.min() < 0 or mod.max() >= self.n_modules):
            raise TraceFormatError(f"{self.path}: /records/module_id out of range")
        names = self.modules["name"].to_numpy()
        df["module"] = names[mod] if len(mod) else []
        return df

    def record_columns(self, fields: list[str]) -> dict[str, np.ndarray]:
        """Selected record columns over the whole trace (e.g. for a module-by-step heatmap)."""
        n = self.records_end
        return self._read_table("records", schema.RECORD_COLUMNS, 0, n, fields)

    @property
    def records_end(self) -> int:
        """One past the last record row any readable step points to."""
        return _span_end(self._step_arrays)

    def engine_table(self, table: str) -> pd.DataFrame:
        """One /engine table (steps | rows | requests | sampled) of a serving-engine run (vLLM);
        empty for a plain HF run or an older trace."""
        if table not in schema.ENGINE_TABLES:
            raise ValueError(f"unknown engine table {table!r}")
        cols = schema.ENGINE_TABLES[table]
        if table not in self._engine_tables:
            return pd.DataFrame({c: np.zeros(0, dt) for c, dt, _ in cols})
        df = pd.DataFrame(self._read_table(f"engine/{table}", cols))
        if table == "requests":
            df["request_id"] = [v.decode("utf-8", "replace") for v in df["request_id"]]
        return df

    @cached_property
    def triggers(self) -> pd.DataFrame:
        """Steps that crossed a flight-recorder trigger (format 1.1; empty before)."""
        cols = [c for c, _, _ in schema.TRIGGER_COLUMNS]
        g = self._f.get("triggers")
        if not isinstance(g, h5py.Group) or not all(
                isinstance(g.get(c), h5py.Dataset) and g[c].ndim == 1 for c in cols):
            return pd.DataFrame({c: [] for c in cols})
        n = min(g[c].shape[0] for c in cols)
        df = pd.DataFrame({c: g[c][:n] for c in cols})
        df["kind"] = [v.decode("utf-8", "replace") for v in df["kind"]] if n else []
        return df

    @cached_property
    def limits(self) -> dict[str, int]:
        """max_bytes the writer ran with (0: none) and the step it was reached at (-1: never)."""
        ds = self._f.get(schema.LIMITS_DATASET)
        if isinstance(ds, h5py.Dataset) and ds.shape == (2,) and ds.dtype.kind in "iu":
            v = ds[:]
            return {"max_bytes": int(v[0]), "reached_at_step": int(v[1])}
        return {"max_bytes": 0, "reached_at_step": -1}

    def iter_steps(self) -> Iterator[int]:
        yield from (int(s) for s in self._step_arrays["step"])


def open_trace(path: str | os.PathLike[str]) -> Trace:
    """Open and validate a trace. Raises TraceFormatError (a QForensicsError) when unusable."""
    return Trace(path)
