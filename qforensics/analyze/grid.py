"""The module-by-step grid of output absmax (log10) over a whole trace, and its reduction to a
bounded number of rows and columns for display. Pure numpy over a few record columns read
through the reader. No torch import."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from qforensics.analyze.findings import FirstNonfinite
from qforensics.trace import schema
from qforensics.trace.reader import Trace

__all__ = ["MAX_HEATMAP_COLS", "MAX_HEATMAP_ROWS", "Grid", "Heatmap", "bin_heatmap", "heatmap_of",
           "read_grid"]

MAX_HEATMAP_ROWS = 200
MAX_HEATMAP_COLS = 200


# -- module x step grid ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Grid:
    values: np.ndarray  # log10 absmax of outputs, (modules in call order) x (steps)
    bad: np.ndarray
    labels: list[str]
    module_ids: np.ndarray  # module id of each row
    steps: np.ndarray  # step value of each column


def read_grid(trace: Trace) -> Grid | None:
    """Max output absmax per (module, step) over the whole trace, rows in first-call order."""
    cols = trace.record_columns(["call_index", "step", "module_id", "io", "absmax", "nan_count",
                                 "inf_count"])
    if len(cols["step"]) == 0:
        return None
    out = cols["io"] == schema.IO_OUTPUT
    if not out.any():
        out = np.ones_like(out, dtype=bool)
    mod = cols["module_id"][out].astype(np.int64)
    step = cols["step"][out].astype(np.int64)
    call = cols["call_index"][out]
    amax = cols["absmax"][out].astype(np.float64)
    bad = (cols["nan_count"][out] > 0) | (cols["inf_count"][out] > 0)
    ok = (mod >= 0) & (mod < trace.n_modules)
    mod, step, call, amax, bad = mod[ok], step[ok], call[ok], amax[ok], bad[ok]
    if not len(mod):
        return None
    # rows: modules ordered by their first call
    first_call: dict[int, int] = {}
    order = np.argsort(call, kind="stable")
    uniq, idx = np.unique(mod[order], return_index=True)
    first = call[order][idx]
    for m, c in zip(uniq, first):
        first_call[int(m)] = int(c)
    mods_sorted = np.array(sorted(first_call, key=lambda m: first_call[m]), dtype=np.int64)
    row_of = np.full(trace.n_modules, -1, dtype=np.int64)
    row_of[mods_sorted] = np.arange(len(mods_sorted))
    steps_u, col = np.unique(step, return_inverse=True)
    r = row_of[mod]
    vals = np.full((len(mods_sorted), len(steps_u)), -np.inf)
    with np.errstate(divide="ignore", invalid="ignore"):
        lg = np.where(np.isfinite(amax) & (amax > 0), np.log10(np.where(amax > 0, amax, 1)),
                      np.nan)
    np.fmax.at(vals, (r, col), np.where(np.isnan(lg), -np.inf, lg))
    vals[np.isneginf(vals)] = np.nan
    badg = np.zeros(vals.shape, dtype=bool)
    np.logical_or.at(badg, (r, col), bad)
    labels = [trace.module_name(int(m)) for m in mods_sorted]
    return Grid(vals, badg, labels, mods_sorted, steps_u)


# -- module x step heatmap -------------------------------------------------------------------------
@dataclass(frozen=True)
class Heatmap:
    """log10 absmax per (module row, step column), binned; `bad` marks cells with NaN/Inf."""

    values: np.ndarray  # float, NaN where no record
    bad: np.ndarray  # bool
    row_labels: list[str]  # one per row (the first module of the bin)
    row_starts: np.ndarray  # first module index of each row
    col_starts: np.ndarray  # first step index of each column
    n_modules: int
    n_steps: int
    mark: tuple[int, int] | None = None  # (row, column) of the first non-finite record

    @property
    def binned(self) -> bool:
        return self.values.shape != (self.n_modules, self.n_steps)


def _bins(n: int, limit: int) -> np.ndarray:
    """Start indices of at most `limit` contiguous bins covering range(n)."""
    if n <= limit:
        return np.arange(n)
    k = math.ceil(n / limit)
    return np.arange(0, n, k)


def bin_heatmap(values: np.ndarray, bad: np.ndarray, labels: list[str],
                max_rows: int = MAX_HEATMAP_ROWS, max_cols: int = MAX_HEATMAP_COLS,
                mark: tuple[int, int] | None = None) -> Heatmap:
    """Reduce a (modules x steps) grid to at most max_rows x max_cols by taking each bin's max
    (NaN-aware) and OR of the non-finite flags. `mark` (module row, step column of the grid)
    becomes the cell of the bin holding it."""
    n_mod, n_steps = values.shape
    rs, cs = _bins(n_mod, max_rows), _bins(n_steps, max_cols)
    v, b = values, bad
    if len(rs) != n_mod:
        filled = np.where(np.isnan(v), -np.inf, v)
        v = np.maximum.reduceat(filled, rs, axis=0)
        v = np.where(np.isneginf(v), np.nan, v)
        b = np.logical_or.reduceat(b, rs, axis=0)
    if len(cs) != n_steps:
        filled = np.where(np.isnan(v), -np.inf, v)
        v = np.maximum.reduceat(filled, cs, axis=1)
        v = np.where(np.isneginf(v), np.nan, v)
        b = np.logical_or.reduceat(b, cs, axis=1)
    cell = None
    if mark is not None and 0 <= mark[0] < n_mod and 0 <= mark[1] < n_steps:
        cell = (int(np.searchsorted(rs, mark[0], side="right") - 1),
                int(np.searchsorted(cs, mark[1], side="right") - 1))
    return Heatmap(v, b, [labels[i] for i in rs], rs, cs, n_mod, n_steps, cell)


def heatmap_of(trace: Trace, first: FirstNonfinite | None) -> Heatmap | None:
    """The trace's module-by-step grid, binned for display, with the cell of the first
    non-finite record (`Findings.first_nonfinite`) marked."""
    grid = read_grid(trace)
    if grid is None:
        return None
    mark = None
    if first is not None:
        rows = [i for i, n in enumerate(grid.labels) if n == first.module]
        cols = np.nonzero(grid.steps == first.step)[0]
        if rows and len(cols):
            mark = (rows[0], int(cols[0]))
    return bin_heatmap(grid.values, grid.bad, grid.labels, mark=mark)
