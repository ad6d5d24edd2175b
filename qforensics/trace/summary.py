"""Every step's summary in a fixed number of rows (format 1.2, `/summary`): the writer's
in-memory copy and the arithmetic of consolidation. No h5py, no torch.

Row i holds the steps [i * resolution, (i + 1) * resolution). A step that would need a row
past the capacity first consolidates adjacent pairs of rows into one (min of the minima, max of
the maxima, sums of sums and counts; the first non-finite step of the earlier row wins) and
doubles the resolution, as a round-robin database keeps coarser archives: nothing is ever
dropped, only thinned. The writer writes the rows a drain touched (`dirty`) in one call.
"""

from __future__ import annotations

import numpy as np

from qforensics.trace import schema
from qforensics.trace.badstep import bad_steps

__all__ = ["Summaries", "combine", "empty_rows", "summary_capacity", "step_summaries"]

_MIN_ROWS, _MAX_ROWS = 256, 65536


def summary_capacity(max_bytes: int) -> int:
    """Rows of /summary for a byte budget: a power of two, about 1/64 of the budget, between
    256 and 65,536 (8.4 MB: at 65,536 rows a day of 20 steps a second is kept at 32 steps a
    row)."""
    if not max_bytes:
        return _MAX_ROWS
    want = max_bytes // 64 // schema.summary_dtype().itemsize
    n = _MIN_ROWS
    while n * 2 <= min(want, _MAX_ROWS):
        n *= 2
    return n


def empty_rows(n: int) -> np.ndarray:
    rows = np.zeros(n, schema.summary_dtype())
    for k in ("step_lo", "step_hi", "first_nonfinite_step", "first_nonfinite_call"):
        rows[k] = -1
    for k in ("logits_min", "logits_max", "t_first", "t_last", "duration_max"):
        rows[k] = np.nan
    return rows


_SUMS = ("count", "logits_mean_sum", "logits_steps", "logits_nan", "logits_inf",
         "nonfinite_steps", "nonfinite_records", "incomplete", "warmup", "bad_requests")


def combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Rows `a` followed by rows `b` (elementwise, same length): one row each."""
    out = empty_rows(len(a))
    ha, hb = a["count"] > 0, b["count"] > 0
    out["step_lo"] = np.where(ha, a["step_lo"], b["step_lo"])
    out["step_hi"] = np.where(hb, b["step_hi"], a["step_hi"])
    out["t_first"] = np.where(ha, a["t_first"], b["t_first"])
    for k in ("t_last", "duration_max", "logits_max"):
        out[k] = np.fmax(a[k], b[k])
    out["logits_min"] = np.fmin(a["logits_min"], b["logits_min"])
    for k in _SUMS:
        out[k] = a[k] + b[k]
    first_a = a["first_nonfinite_step"] >= 0
    for k in ("first_nonfinite_step", "first_nonfinite_call"):
        out[k] = np.where(first_a, a[k], b[k])
    return out


def step_summaries(steps: np.ndarray, warm: np.ndarray, bad_requests: np.ndarray
                   ) -> np.ndarray:
    """One summary row per /steps row (`warm`: engine warm-up flags; `bad_requests`: requests
    whose logits row held NaN/Inf, per step)."""
    n = len(steps)
    out = empty_rows(n)
    out["step_lo"] = out["step_hi"] = steps["step"]
    out["count"] = 1
    out["t_first"] = steps["t_start"]
    out["t_last"] = steps["t_start"] + steps["duration"]
    out["duration_max"] = steps["duration"]
    has = steps["has_logits"] > 0
    for k in ("logits_min", "logits_max"):
        out[k] = np.where(has, steps[k], np.nan)
    mean = steps["logits_mean"].astype(np.float64)
    ok = has & np.isfinite(mean)
    out["logits_mean_sum"] = np.where(ok, mean, 0.0)
    out["logits_steps"] = ok
    out["logits_nan"], out["logits_inf"] = steps["logits_nan"], steps["logits_inf"]
    bad = bad_steps(steps, warmup=warm)
    out["nonfinite_steps"] = bad
    out["first_nonfinite_step"] = np.where(bad, steps["step"], -1)
    out["first_nonfinite_call"] = np.where(bad, steps["first_nonfinite_call"], -1)
    out["nonfinite_records"] = steps["n_nonfinite_records"]
    out["incomplete"] = steps["complete"] == 0
    out["warmup"] = warm
    out["bad_requests"] = bad_requests
    return out


def _fold(rows: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """One row per run of rows beginning at `starts` (vectorized `combine` over each run)."""
    ends = np.concatenate([starts[1:], [len(rows)]]) - 1
    out = empty_rows(len(starts))
    for k in ("step_lo", "t_first"):
        out[k] = rows[k][starts]
    out["step_hi"] = rows["step_hi"][ends]
    for k in ("t_last", "duration_max", "logits_max"):
        out[k] = np.fmax.reduceat(rows[k], starts)
    out["logits_min"] = np.fmin.reduceat(rows["logits_min"], starts)
    for k in _SUMS:
        out[k] = np.add.reduceat(rows[k], starts)
    pos = np.where(rows["first_nonfinite_step"] >= 0, np.arange(len(rows)), len(rows))
    first = np.minimum.reduceat(pos, starts)
    hit = first < len(rows)
    for k in ("first_nonfinite_step", "first_nonfinite_call"):
        out[k] = np.where(hit, rows[k][np.minimum(first, len(rows) - 1)], -1)
    return out


class Summaries:
    """The writer's copy of /summary: `add` folds step rows in, `dirty` says what to write."""

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        self.rows = empty_rows(self.capacity)
        self.resolution = 1
        self.seen = 0
        self.used = 0
        self.dirty: tuple[int, int] | None = None

    def state(self) -> np.ndarray:
        return np.array([self.resolution, self.used, self.seen, self.capacity], np.int64)

    def _touch(self, lo: int, hi: int) -> None:
        d = self.dirty
        self.dirty = (lo, hi) if d is None else (min(d[0], lo), max(d[1], hi))

    def _consolidate(self) -> None:
        half = self.capacity // 2
        merged = combine(self.rows[0::2], self.rows[1::2])
        self.rows[:half] = merged
        self.rows[half:] = empty_rows(self.capacity - half)
        self.resolution *= 2
        self.used = -(-self.used // 2)
        self._touch(0, self.capacity)

    def add(self, rows: np.ndarray) -> None:
        """Fold per-step summary rows (`step_summaries`, steps ascending) in."""
        if not len(rows):
            return
        steps = rows["step_lo"]
        if int(steps[0]) < 0:
            return
        while int(steps[-1]) // self.resolution >= self.capacity:
            self._consolidate()
        idx = steps // self.resolution
        starts = np.concatenate([[0], np.nonzero(np.diff(idx))[0] + 1])
        groups = idx[starts]
        agg = rows[starts].copy() if len(starts) == len(rows) else _fold(rows, starts)
        self.rows[groups] = combine(self.rows[groups], agg)
        self.seen += len(rows)
        self.used = max(self.used, int(groups[-1]) + 1)
        self._touch(int(groups[0]), int(groups[-1]) + 1)
