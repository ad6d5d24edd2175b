"""`Table`: equal-length numpy columns by name, the reader's own view of a trace table.

The analysis and the report read steps, records and snapshots as `Table`s: plain numpy, no
pandas import (pandas alone costs about a third of a second of start-up, more than the whole
analysis of a 1 GB trace). `Trace.steps`, `Trace.records()` and the other DataFrame views are
built from these on demand for callers that want pandas (`Table.to_frame()`). No torch import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["Table"]


class Table:
    """Columns of equal length (a column may have trailing dimensions: one row per entry of
    its first axis). Indexing by a column name gives the numpy array; `take` selects rows."""

    __slots__ = ("_cols", "_n")

    def __init__(self, cols: dict[str, Any], n: int | None = None) -> None:
        self._cols = {k: v if isinstance(v, np.ndarray) else np.asarray(v)
                      for k, v in cols.items()}
        lens = {len(v) for v in self._cols.values()}
        if len(lens) > 1:
            raise ValueError(f"columns of unequal length: {sorted(lens)}")
        self._n = lens.pop() if lens else int(n or 0)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, name: str) -> np.ndarray:
        return self._cols[name]

    def __contains__(self, name: object) -> bool:
        return name in self._cols

    def __iter__(self) -> Iterator[str]:
        return iter(self._cols)

    @property
    def columns(self) -> list[str]:
        return list(self._cols)

    @property
    def empty(self) -> bool:
        return self._n == 0

    def take(self, sel: np.ndarray | slice | list[int]) -> "Table":
        """The rows picked by a boolean mask, positions or a slice, in that order."""
        if isinstance(sel, slice):
            return Table({k: v[sel] for k, v in self._cols.items()}, len(range(self._n)[sel]))
        idx = np.asarray(sel)
        if idx.dtype == bool:
            if idx.shape != (self._n,):
                raise ValueError(f"mask of shape {idx.shape} for {self._n} rows")
            idx = np.nonzero(idx)[0]
        idx = idx.astype(np.intp, copy=False)
        return Table({k: v[idx] for k, v in self._cols.items()}, len(idx))

    def row(self, i: int) -> dict[str, Any]:
        """Row `i` (a position) as {column: value}."""
        return {k: v[i] for k, v in self._cols.items()}

    def with_columns(self, **cols: Any) -> "Table":
        """A copy with columns added or replaced (the arrays are shared, not copied)."""
        out = dict(self._cols)
        out.update(cols)
        return Table(out, self._n)

    def to_frame(self) -> "pd.DataFrame":
        """A pandas DataFrame of the same columns. Text (object) columns go in as lists, so
        pandas infers their dtype as it does for lists; a column with trailing dimensions
        becomes a column of arrays, after the others."""
        import pandas as pd

        flat = {k: list(v) if v.dtype == object else v
                for k, v in self._cols.items() if v.ndim <= 1}
        df = pd.DataFrame(flat)
        for k, v in self._cols.items():
            if v.ndim > 1:
                df[k] = list(v)
        return df

    def __repr__(self) -> str:
        return f"Table({self._n} rows: {', '.join(self._cols)})"
