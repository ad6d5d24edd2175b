"""Bulk reads the analyzer needs beyond the reader's per-record accessors.

`Trace.channel_ranges(row)` reads one record at a time; the analyzer wants the per-channel ranges
(and per-token absmax) of every record of ONE step, which lie in one contiguous span of
/channels/min, /channels/max and /tokens/absmax. These helpers read that span once through the
reader's bounds-checked `Trace.channel_span` / `Trace.token_span` and hand out views.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from qforensics.trace.reader import Trace


@dataclass
class Block:
    """A span [lo, hi) of one or two flat arrays, read once."""

    lo: int
    a: np.ndarray
    b: np.ndarray | None = None

    def get(self, off: int, n: int) -> tuple[np.ndarray, np.ndarray | None]:
        i = off - self.lo
        return self.a[i:i + n], (None if self.b is None else self.b[i:i + n])


def _span(offs: np.ndarray, counts: np.ndarray) -> tuple[int, int]:
    ok = offs >= 0
    if not ok.any():
        return 0, 0
    return int(offs[ok].min()), int((offs[ok] + np.maximum(counts[ok], 0)).max())


def read_channel_block(trace: Trace, recs: pd.DataFrame) -> Block | None:
    """Per-channel min and max (float32) covering every record of `recs` that stores them."""
    lo, hi = _span(recs["chan_offset"].to_numpy(np.int64), recs["channels"].to_numpy(np.int64))
    if hi <= lo:
        return None
    cmin, cmax = trace.channel_span(lo, hi)
    return Block(lo, cmin, cmax)


def read_token_block(trace: Trace, recs: pd.DataFrame) -> Block | None:
    """Per-token absmax covering every record of `recs` that stores it."""
    lo, hi = _span(recs["tok_offset"].to_numpy(np.int64), recs["tok_count"].to_numpy(np.int64))
    if hi <= lo:
        return None
    return Block(lo, trace.token_span(lo, hi))


def read_channel_slice(trace: Trace, off: int, n: int) -> tuple[np.ndarray, np.ndarray] | None:
    """One record's channel ranges, by offset (used for trends over earlier steps)."""
    if off < 0 or n <= 0:
        return None
    return trace.channel_span(off, off + n)


def channel_absmax(cmin: np.ndarray, cmax: np.ndarray) -> np.ndarray:
    """max(|min|, |max|) per channel; channels with no finite value count as 0."""
    a = np.fmax(np.abs(cmin.astype(np.float64)), np.abs(cmax.astype(np.float64)))
    return np.where(np.isfinite(a), a, 0.0)


def first_occurrence(recs: pd.DataFrame) -> pd.DataFrame:
    """Keep the first call of each (module, io, slot) in a step (a module may run twice)."""
    return recs.drop_duplicates(subset=["module_id", "io", "slot"], keep="first")
