"""Reading the snapshots (full tensors kept for calls that matter) and the runtime-guard
incidents of a trace, validated: a dtype whitelist, shapes from bounded JSON checked against the
byte count with Python ints, every read bounds-checked and guarded. Nothing is unpickled; no
torch import."""

from __future__ import annotations

import math
from collections.abc import Collection
from functools import cached_property
from typing import TYPE_CHECKING

import h5py
import numpy as np

from qforensics.errors import TraceFormatError
from qforensics.trace import schema
from qforensics.trace.table import Table
from qforensics.trace.validate import checked_span, parse_json, read

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["MAX_SNAPSHOT_ELEMENTS", "SnapshotAccess"]

MAX_SNAPSHOT_ELEMENTS = 1 << 31


class SnapshotAccess:
    """The snapshot and incident reads of `Trace` (a mixin: `Trace` provides the file, the
    array lengths and the module table)."""

    path: str
    _lengths: dict[str, int]
    _has_incidents: bool
    n_modules: int
    module_names: np.ndarray

    def _ds(self, path: str) -> h5py.Dataset:  # provided by Trace
        raise NotImplementedError

    def _read_table(self, table: str, columns: list, start: int = 0, stop: int | None = None,
                    fields: list[str] | None = None) -> dict[str, np.ndarray]:
        raise NotImplementedError  # provided by Trace

    @cached_property
    def snapshot_table(self) -> Table:
        """The /snapshots/index rows as a `Table`, strings decoded, with `module` (its name)."""
        data = self._read_table("snapshots/index", schema.SNAPSHOT_COLUMNS)
        for col in ("reason", "name", "dtype", "shape"):
            data[col] = _decode(data[col])
        mod = data["module_id"]
        names = self.module_names
        ok = (mod >= 0) & (mod < self.n_modules)
        data["module"] = _objects([names[m] if k else f"<unknown {m}>" for m, k in zip(mod, ok)])
        return Table(data)

    @cached_property
    def snapshots(self) -> pd.DataFrame:
        return self.snapshot_table.to_frame()

    def snapshot_tensors(self, call_index: int, names: Collection[str] | None = None
                         ) -> dict[str, np.ndarray]:
        """The tensors kept for one call, validated (dtype whitelist, shape vs byte count);
        `names`: only these of them (e.g. `{"call.json"}`, without reading the weights)."""
        t = self.snapshot_table
        hit = np.nonzero(t["call_index"] == int(call_index))[0]
        if names is not None and len(hit):
            hit = hit[np.isin(t["name"][hit].astype(str), list(names))]
            if not len(hit):
                return {}
        if not len(hit):
            raise TraceFormatError(f"{self.path}: no snapshot for call {call_index}; calls with "
                                   f"snapshots: {sorted(set(t['call_index'].tolist()))}")
        out: dict[str, np.ndarray] = {}
        data = self._ds("snapshots/data")
        for r in (t.row(int(i)) for i in hit):
            where = f"{self.path}: snapshot {r['name']!r} of call {call_index}"
            if r["dtype"] not in schema.SNAPSHOT_DTYPES:
                raise TraceFormatError(f"{where}: dtype {r['dtype']!r} not allowed")
            shape = parse_json(r["shape"], where)
            if (not isinstance(shape, list) or len(shape) > 8
                    or not all(isinstance(s, int) and s >= 0 for s in shape)):
                raise TraceFormatError(f"{where}: bad shape {r['shape']!r}")
            dt = np.dtype(r["dtype"]).newbyteorder("<")
            count = math.prod(shape)  # Python ints: no wrap
            off, nbytes = int(r["offset"]), int(r["nbytes"])
            if count > MAX_SNAPSHOT_ELEMENTS or nbytes != count * dt.itemsize:
                raise TraceFormatError(f"{where}: {nbytes} bytes do not hold shape {shape}")
            lo, hi = checked_span(off, nbytes, self._lengths["snapshots/data"], where)
            raw = read(data, slice(lo, hi), where)
            out[r["name"]] = np.frombuffer(raw.tobytes(), dtype=dt).reshape(shape)
        return out

    @cached_property
    def incident_table(self) -> Table:
        """Runtime-guard trips (qforensics.guard) as a `Table`: step, call_index, module,
        action, counts, detail."""
        if not self._has_incidents:
            return Table({c: np.zeros(0, dt) if "S" not in dt else _objects([])
                          for c, dt, _ in schema.INCIDENT_COLUMNS})
        data = self._read_table("incidents", schema.INCIDENT_COLUMNS)
        for col in ("module", "action", "detail"):
            data[col] = _decode(data[col])
        return Table(data)

    @cached_property
    def incidents(self) -> pd.DataFrame:
        """`incident_table` as a pandas DataFrame."""
        import pandas as pd

        if not self._has_incidents:
            return pd.DataFrame({c: [] for c, _, _ in schema.INCIDENT_COLUMNS})
        return self.incident_table.to_frame()


def _objects(values: list) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def _decode(values: np.ndarray) -> np.ndarray:
    return _objects([v.decode("utf-8", "replace") for v in values])
