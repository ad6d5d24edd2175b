"""The side tables of a trace: a serving engine's /engine tables (vLLM), the flight recorder's
/triggers and its size limit. A mixin of `Trace`; numpy `Table`s for the analysis, pandas views
on demand. No torch import.
"""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING

import h5py
import numpy as np

from qforensics.trace import schema
from qforensics.trace.table import Table

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["SideTables"]


def _decode(values: np.ndarray) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = [v.decode("utf-8", "replace") for v in values]
    return out


class SideTables:
    """/engine, /triggers and the size limit (a mixin: `Trace` provides the file and the
    validated list of engine tables)."""

    _f: h5py.File
    _engine_tables: list[str]

    def _read_table(self, table: str, columns: list, start: int = 0, stop: int | None = None,
                    fields: list[str] | None = None) -> dict[str, np.ndarray]:
        raise NotImplementedError  # provided by Trace

    def engine_columns(self, table: str) -> Table:
        """One /engine table (steps | rows | requests | sampled) of a serving-engine run (vLLM)
        as a `Table`; empty for a plain HF run or an older trace."""
        if table not in schema.ENGINE_TABLES:
            raise ValueError(f"unknown engine table {table!r}")
        cols = schema.ENGINE_TABLES[table]
        if table not in self._engine_tables:
            return Table({c: np.zeros(0, dt) for c, dt, _ in cols})
        data = self._read_table(f"engine/{table}", cols)
        if table == "requests":
            data["request_id"] = _decode(data["request_id"])
        return Table(data)

    def engine_table(self, table: str) -> pd.DataFrame:
        """`engine_columns` as a pandas DataFrame."""
        return self.engine_columns(table).to_frame()

    @cached_property
    def triggers(self) -> pd.DataFrame:
        """Steps that crossed a flight-recorder trigger (format 1.1; empty before)."""
        import pandas as pd

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
    def param_watch(self) -> Table:
        """Parameters found holding NaN/Inf during the run (hooks/paramwatch.py), one row per
        tensor at the first check that saw it (schema.PARAM_WATCH_COLUMNS; `module`, `param`
        and `trigger` decoded). Empty for a trace without the table (parameters checked at
        attach only) or with a malformed one."""
        cols = schema.PARAM_WATCH_COLUMNS
        empty = Table({c: np.zeros((0, *sh), dt) if "S" not in dt else _decode(np.zeros(0, dt))
                       for c, dt, sh in cols})
        g = self._f.get("param_watch")
        if not isinstance(g, h5py.Group):
            return empty
        try:
            ds = {c: g.get(c) for c, _, _ in cols}
            if not all(isinstance(d, h5py.Dataset) and d.shape[1:] == sh
                       and d.dtype.kind == np.dtype(dt).kind for (c, dt, sh), d in
                       zip(cols, ds.values())):
                return empty
            n = min(min(d.shape[0] for d in ds.values()), 100_000)
            data = {c: np.asarray(d[:n]) for c, d in ds.items()}
        except (OSError, KeyError, ValueError, TypeError):  # a damaged table: none read
            return empty
        for c in ("module", "param", "trigger"):
            data[c] = _decode(data[c])
        return Table(data)

    @cached_property
    def hits_checked(self) -> dict[str, int] | None:
        """The writer's /engine/hits bookkeeping: non-finite steps it saw (`bad_steps`), those it
        scanned for first hits (`scanned`), hit rows it dropped (`dropped`); None when the trace
        lacks it (an HF run's trace has zeros; an older trace none)."""
        ds = self._f.get(schema.HITS_CHECKED)
        if isinstance(ds, h5py.Dataset) and ds.shape == (3,) and ds.dtype.kind in "iu":
            v = [max(0, int(x)) for x in ds[:]]
            return {"bad_steps": v[0], "scanned": v[1], "dropped": v[2]}
        return None

    @cached_property
    def limits(self) -> dict[str, int]:
        """max_bytes the writer ran with (0: none) and the step it was reached at (-1: never)."""
        ds = self._f.get(schema.LIMITS_DATASET)
        if isinstance(ds, h5py.Dataset) and ds.shape == (2,) and ds.dtype.kind in "iu":
            v = ds[:]
            return {"max_bytes": int(v[0]), "reached_at_step": int(v[1])}
        return {"max_bytes": 0, "reached_at_step": -1}
