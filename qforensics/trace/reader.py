"""Validating trace reader: numpy and pandas views of a qforensics HDF5 trace.

Trace files are untrusted input. The reader checks the format name and version (refusing a newer
major version), refuses external links and external storage, checks every column's dtype and
every offset against the arrays it points into, and never unpickles anything. A trace left behind
by a crashed or killed run (SWMR flags still set, columns of unequal length) is opened as far as
it goes and says where it ends. No torch import.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterator

import h5py
import numpy as np
import pandas as pd

from qforensics.errors import TraceFormatError, TraceVersionError
from qforensics.trace import schema
from qforensics.trace.ring import RingIndex

log = logging.getLogger(__name__)

MAX_JSON_BYTES = 4 << 20
MAX_SNAPSHOT_ELEMENTS = 1 << 31


@dataclass(frozen=True)
class TraceEnd:
    complete: bool  # the writer closed the file
    last_step: int  # -1 when no step was written
    reason: str  # human sentence: how and where the trace ends


def _open_h5(path: str) -> h5py.File:
    if not os.path.exists(path):
        raise TraceFormatError(f"{path}: no such file")
    if not h5py.is_hdf5(path):
        raise TraceFormatError(f"{path}: not an HDF5 file (is this a qforensics trace?)")
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        if "already open for write" not in str(exc) and "consistency flags" not in str(exc):
            raise TraceFormatError(f"{path}: cannot open: {exc}") from exc
    try:  # left behind by a killed writer: SWMR read still works
        return h5py.File(path, "r", swmr=True)
    except OSError as exc:
        raise TraceFormatError(f"{path}: cannot open (writer did not close it): {exc}") from exc


def _check_links(f: h5py.File, path: str) -> None:
    """Refuse soft/external links and datasets with external storage anywhere in the file."""
    bad: list[str] = []
    stack: list[h5py.Group] = [f]
    while stack:
        grp = stack.pop()
        for key in grp.keys():
            link = grp.get(key, getlink=True)
            full = f"{grp.name.rstrip('/')}/{key}"
            if not isinstance(link, h5py.HardLink):
                bad.append(full)
                continue
            obj = grp.get(key)
            if isinstance(obj, h5py.Group):
                stack.append(obj)
            elif isinstance(obj, h5py.Dataset) and obj.external:
                bad.append(full + " (external storage)")
    if bad:
        raise TraceFormatError(
            f"{path}: refusing links or external storage at {', '.join(bad[:5])}; "
            "a trace must be self-contained"
        )


def _parse_json(raw: Any, where: str) -> Any:
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8", errors="replace")
    if not isinstance(raw, str):
        raise TraceFormatError(f"{where}: expected a JSON string, found {type(raw).__name__}")
    if len(raw) > MAX_JSON_BYTES:
        raise TraceFormatError(f"{where}: JSON larger than {MAX_JSON_BYTES} bytes")
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: invalid JSON ({exc})") from exc


class Trace:
    """An open trace. Use as a context manager or call `close()`.

    `meta` is a dict; `modules`, `steps`, `records()` and `snapshots` are pandas DataFrames;
    per-channel and per-token arrays come from `channel_ranges` and `token_absmax`.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._f = _open_h5(self.path)
        try:
            self._validate()
        except TraceFormatError:
            self._f.close()
            raise
        except (KeyError, ValueError, TypeError, OSError) as exc:
            self._f.close()
            raise TraceFormatError(f"{self.path}: malformed trace ({exc})") from exc

    # -- validation --------------------------------------------------------------------------
    def _validate(self) -> None:
        f, p = self._f, self.path
        name = f.attrs.get("format")
        if isinstance(name, bytes):
            name = name.decode("utf-8", "replace")
        if name != schema.FORMAT_NAME:
            raise TraceFormatError(f"{p}: not a qforensics trace (root attribute format={name!r})")
        ver = f.attrs.get("format_version")
        if isinstance(ver, bytes):
            ver = ver.decode()
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
        _check_links(f, p)
        self._lengths: dict[str, int] = {}
        for table, columns in (("steps", schema.STEP_COLUMNS), ("records", schema.RECORD_COLUMNS)):
            self._lengths[table] = self._check_table(table, columns)
        self._lengths["snapshots/index"] = self._check_table(
            "snapshots/index", schema.SNAPSHOT_COLUMNS
        )
        # /incidents arrived in format 1.0 from the start; tolerate its absence (minor versions)
        self._has_incidents = isinstance(self._f.get("incidents"), h5py.Group)
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
            if ds.ndim != 1:
                raise TraceFormatError(f"{p}: /{path} must be 1-D")
            kind = np.dtype(dt).kind
            if ds.dtype.kind != kind:
                raise TraceFormatError(f"{p}: /{path} has dtype {ds.dtype}, expected kind {kind}")
            self._lengths[path] = ds.shape[0]
        for col, _ in schema.MODULE_COLUMNS:
            ds = self._dataset(f"modules/{col}")
            if ds.dtype.kind not in "OS":
                raise TraceFormatError(f"{p}: /modules/{col} must hold strings")
        self._ring = RingIndex(f, p, min(self._lengths["channels/min"],
                                         self._lengths["channels/max"]))
        n_mod = {self._f[f"modules/{c}"].shape[0] for c, _ in schema.MODULE_COLUMNS}
        if len(n_mod) != 1:
            raise TraceFormatError(f"{p}: /modules columns differ in length")
        self.n_modules = n_mod.pop()

    def _dataset(self, path: str) -> h5py.Dataset:
        obj = self._f.get(path)
        if not isinstance(obj, h5py.Dataset):
            raise TraceFormatError(f"{self.path}: missing dataset /{path}")
        return obj

    def _check_table(self, table: str, columns: list) -> int:
        n = None
        for name, dt, shape in columns:
            ds = self._dataset(f"{table}/{name}")
            want = np.dtype(dt)
            ok = ds.dtype.kind == want.kind or (want.kind in "iu" and ds.dtype.kind in "iu")
            if not ok or tuple(ds.shape[1:]) != tuple(shape):
                raise TraceFormatError(
                    f"{self.path}: /{table}/{name} has dtype {ds.dtype} shape {ds.shape}, "
                    f"expected {want} with trailing shape {shape}"
                )
            n = ds.shape[0] if n is None else min(n, ds.shape[0])  # killed mid-append: shortest
        return int(n or 0)

    # -- plumbing ----------------------------------------------------------------------------
    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "Trace":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read_table(self, table: str, columns: list, start: int = 0, stop: int | None = None,
                    fields: list[str] | None = None) -> dict[str, np.ndarray]:
        n = self._lengths[table]
        stop = n if stop is None else max(start, min(stop, n))
        out = {}
        for name, _, _ in columns:
            if fields is not None and name not in fields:
                continue
            out[name] = self._f[f"{table}/{name}"][start:stop]
        if table == "records" and "chan_offset" in out:  # 1.1: ring-relative -> addresses
            need = {k: out[k] if k in out else self._f[f"records/{k}"][start:stop]
                    for k in ("flags", "step", "channels")}
            out["chan_offset"] = self._ring.resolve(out["chan_offset"], need["flags"],
                                                    need["step"], need["channels"])
        return out

    # -- metadata ----------------------------------------------------------------------------
    @cached_property
    def meta(self) -> dict[str, Any]:
        """environment, capture_options, status (absent: writer never closed), outcome."""
        g = self._f.get("meta")
        out: dict[str, Any] = {}
        if isinstance(g, h5py.Group):
            for key in schema.META_KEYS:
                if key in g.attrs:
                    out[key] = _parse_json(g.attrs[key], f"{self.path}: /meta@{key}")
        return out

    @cached_property
    def modules(self) -> pd.DataFrame:
        cols = {}
        for col, _ in schema.MODULE_COLUMNS:
            vals = self._f[f"modules/{col}"][:]
            cols[col] = [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
                         for v in vals]
        df = pd.DataFrame(cols)
        df.index.name = "module_id"
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
        raw = self._read_table("steps", schema.STEP_COLUMNS)
        # keep only steps whose records are fully on disk
        end = raw["record_offset"] + raw["record_count"]
        ok = (raw["record_offset"] >= 0) & (raw["record_count"] >= 0) & (
            end <= self._lengths["records"])
        tok_end = raw["token_offset"] + raw["token_count"]
        ok &= (raw["token_offset"] >= 0) & (tok_end <= self._lengths["tokens/input_ids"])
        if not ok.all():
            bad = int(np.argmin(ok))
            log.warning("%s: step rows from %d on point past the data; ignoring them", self.path, bad)
            raw = {k: v[:bad] for k, v in raw.items()}
        return raw

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
        off = int(self._step_arrays["token_offset"][r])
        n = int(self._step_arrays["token_count"][r])
        return self._f["tokens/input_ids"][off:off + n]

    @cached_property
    def end(self) -> TraceEnd:
        status = self.meta.get("status")
        n = self.n_steps
        last = int(self._step_arrays["step"][-1]) if n else -1
        if isinstance(status, dict) and status.get("state"):
            state = str(status.get("state"))
            if state == "complete":
                return TraceEnd(True, last, f"complete: {n} steps")
            return TraceEnd(True, last, f"run ended with {state}: "
                            f"{status.get('error', '')}".rstrip(": "))
        orphan = self._lengths["records"] - (
            int(self._step_arrays["record_offset"][-1] + self._step_arrays["record_count"][-1])
            if n else 0)
        return TraceEnd(False, last, "truncated: the writer never closed the file (the run "
                        f"crashed or was killed); trace ends after step {last}"
                        + (f", {orphan} records of a later step are incomplete" if orphan else ""))

    # -- records -----------------------------------------------------------------------------
    def records(self, step: int | None = None, *, start: int | None = None,
                stop: int | None = None) -> pd.DataFrame:
        """Records of one step (or a row range, or everything), with a `row` column."""
        if step is not None:
            r = self.step_row(step)
            start = int(self._step_arrays["record_offset"][r])
            stop = start + int(self._step_arrays["record_count"][r])
        start = 0 if start is None else int(start)
        if stop is None:
            n = self.n_steps
            stop = (int(self._step_arrays["record_offset"][-1] + self._step_arrays["record_count"][-1])
                    if n else 0)
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
        n = self.n_steps
        if not n:
            return 0
        return int(self._step_arrays["record_offset"][-1] + self._step_arrays["record_count"][-1])

    def channel_span(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Per-channel (min, max) values [lo, hi) of the flat arrays as float32, bounds-checked:
        one read for the records of a whole step (their slices are contiguous)."""
        lo, hi = int(lo), int(hi)
        n = min(self._lengths["channels/min"], self._lengths["channels/max"])
        if lo >= n and hi > lo:  # 1.1: a block still in the ring (see trace/ring.py)
            got = self._ring.read(lo, hi)
            if got is not None:
                return (got[0].astype(np.float32, copy=False),
                        got[1].astype(np.float32, copy=False))
        if lo < 0 or hi < lo or hi > n:
            raise TraceFormatError(f"{self.path}: channel range [{lo}, {hi}) out of bounds "
                                   f"(/channels holds {n})")
        return (self._f["channels/min"][lo:hi].astype(np.float32, copy=False),
                self._f["channels/max"][lo:hi].astype(np.float32, copy=False))

    def token_span(self, lo: int, hi: int) -> np.ndarray:
        """Per-token absmax values [lo, hi) as float32, bounds-checked."""
        lo, hi = int(lo), int(hi)
        n = self._lengths["tokens/absmax"]
        if lo < 0 or hi < lo or hi > n:
            raise TraceFormatError(f"{self.path}: token range [{lo}, {hi}) out of bounds "
                                   f"(/tokens/absmax holds {n})")
        return self._f["tokens/absmax"][lo:hi].astype(np.float32, copy=False)

    def channel_ranges(self, row: int | pd.Series) -> tuple[np.ndarray, np.ndarray] | None:
        """Per-channel (min, max) of one record as float32, or None when not stored."""
        rec = self._record(row)
        off, n = int(rec["chan_offset"]), int(rec["channels"])
        if off < 0:
            return None
        if n < 0:
            raise TraceFormatError(f"{self.path}: record {rec['row']} has {n} channels")
        return self.channel_span(off, off + n)

    def token_absmax(self, row: int | pd.Series) -> np.ndarray | None:
        rec = self._record(row)
        off, n = int(rec["tok_offset"]), int(rec["tok_count"])
        if off < 0:
            return None
        if n < 0:
            raise TraceFormatError(f"{self.path}: record {rec['row']} has {n} tokens")
        return self.token_span(off, off + n)

    def _record(self, row: int | pd.Series) -> dict[str, Any]:
        if isinstance(row, pd.Series):
            return {"row": row.get("row", -1), **{k: row[k] for k in
                    ("chan_offset", "channels", "tok_offset", "tok_count")}}
        row = int(row)
        if not 0 <= row < self._lengths["records"]:
            raise TraceFormatError(f"{self.path}: no record row {row}")
        d = self._read_table("records", schema.RECORD_COLUMNS, row, row + 1,
                             ["chan_offset", "channels", "tok_offset", "tok_count"])
        return {"row": row, **{k: v[0] for k, v in d.items()}}

    def channels_for(self, module: str, step: int, io: int = schema.IO_INPUT,
                     slot: int = 0) -> tuple[np.ndarray, np.ndarray] | None:
        """Per-channel (min, max) of `module`'s input (or output) at `step` (first call)."""
        df = self.records(step)
        sel = df[(df["module"] == module) & (df["io"] == io) & (df["slot"] == slot)]
        if sel.empty:
            return None
        return self.channel_ranges(int(sel["row"].iloc[0]))

    # -- snapshots ---------------------------------------------------------------------------
    @cached_property
    def snapshots(self) -> pd.DataFrame:
        data = self._read_table("snapshots/index", schema.SNAPSHOT_COLUMNS)
        df = pd.DataFrame({k: v for k, v in data.items()})
        for col in ("reason", "name", "dtype", "shape"):
            df[col] = [v.decode("utf-8", "replace") for v in df[col]] if len(df) else []
        mod = df["module_id"].to_numpy() if len(df) else np.zeros(0, int)
        names = self.modules["name"].to_numpy()
        ok = (mod >= 0) & (mod < self.n_modules)
        df["module"] = [names[m] if k else f"<unknown {m}>" for m, k in zip(mod, ok)]
        return df

    def snapshot_tensors(self, call_index: int) -> dict[str, np.ndarray]:
        """The tensors kept for one call, validated (dtype whitelist, shape vs byte count)."""
        df = self.snapshots
        sel = df[df["call_index"] == int(call_index)]
        if sel.empty:
            raise TraceFormatError(f"{self.path}: no snapshot for call {call_index}; calls with "
                                   f"snapshots: {sorted(set(df['call_index'].tolist()))}")
        out: dict[str, np.ndarray] = {}
        data = self._f["snapshots/data"]
        for _, r in sel.iterrows():
            where = f"{self.path}: snapshot {r['name']!r} of call {call_index}"
            if r["dtype"] not in schema.SNAPSHOT_DTYPES:
                raise TraceFormatError(f"{where}: dtype {r['dtype']!r} not allowed")
            shape = _parse_json(r["shape"], where)
            if (not isinstance(shape, list) or len(shape) > 8
                    or not all(isinstance(s, int) and s >= 0 for s in shape)):
                raise TraceFormatError(f"{where}: bad shape {r['shape']!r}")
            dt = np.dtype(r["dtype"]).newbyteorder("<")
            count = int(np.prod(shape, dtype=np.int64)) if shape else 1
            off, nbytes = int(r["offset"]), int(r["nbytes"])
            if count > MAX_SNAPSHOT_ELEMENTS or nbytes != count * dt.itemsize:
                raise TraceFormatError(f"{where}: {nbytes} bytes do not hold shape {shape}")
            if off < 0 or off + nbytes > self._lengths["snapshots/data"]:
                raise TraceFormatError(f"{where}: data out of bounds")
            raw = data[off:off + nbytes]
            out[r["name"]] = np.frombuffer(raw.tobytes(), dtype=dt).reshape(shape)
        return out

    @cached_property
    def incidents(self) -> pd.DataFrame:
        """Runtime-guard trips (qforensics.guard): step, call_index, module, action, counts."""
        cols = [c for c, _, _ in schema.INCIDENT_COLUMNS]
        if not self._has_incidents:
            return pd.DataFrame({c: [] for c in cols})
        data = self._read_table("incidents", schema.INCIDENT_COLUMNS)
        df = pd.DataFrame(data)
        for col in ("module", "action", "detail"):
            df[col] = [v.decode("utf-8", "replace") for v in df[col]] if len(df) else []
        return df

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
