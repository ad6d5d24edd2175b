"""Bulk reads the analyzer needs beyond the reader's per-record accessors.

`Trace.channel_ranges(row)` reads one record at a time; the analyzer wants the per-channel ranges
(and per-token absmax) of every record of ONE step, which lie in one contiguous span of
/channels/min, /channels/max and /tokens/absmax. These helpers read that span once and hand out
views, checking every offset against the dataset lengths (trace content is untrusted). They reach
into the open h5py file of the `Trace` (`trace._f`): the reader has no bulk accessor yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from qforensics.errors import TraceFormatError
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


def _dataset_len(trace: Trace, path: str) -> int:
    known = getattr(trace, "_lengths", {})  # the reader measured them while validating
    return int(known[path]) if path in known else int(trace._f[path].shape[0])


def _span(trace: Trace, offs: np.ndarray, counts: np.ndarray, path: str) -> tuple[int, int]:
    ok = offs >= 0
    if not ok.any():
        return 0, 0
    lo = int(offs[ok].min())
    hi = int((offs[ok] + counts[ok]).max())
    if (counts[ok] < 0).any() or hi > _dataset_len(trace, path):
        raise TraceFormatError(f"{trace.path}: a record's offset points past /{path} "
                               f"({hi} > {_dataset_len(trace, path)})")
    return lo, hi


def read_channel_block(trace: Trace, recs: pd.DataFrame) -> Block | None:
    """Per-channel min and max (float32) covering every record of `recs` that stores them."""
    offs = recs["chan_offset"].to_numpy(np.int64)
    cnt = recs["channels"].to_numpy(np.int64)
    lo, hi = _span(trace, offs, cnt, "channels/min")
    if hi <= lo:
        return None
    if hi > _dataset_len(trace, "channels/max"):
        raise TraceFormatError(f"{trace.path}: /channels/max shorter than /channels/min")
    cmin = trace._f["channels/min"][lo:hi].astype(np.float32, copy=False)
    cmax = trace._f["channels/max"][lo:hi].astype(np.float32, copy=False)
    return Block(lo, cmin, cmax)


def read_token_block(trace: Trace, recs: pd.DataFrame) -> Block | None:
    """Per-token absmax covering every record of `recs` that stores it."""
    offs = recs["tok_offset"].to_numpy(np.int64)
    cnt = recs["tok_count"].to_numpy(np.int64)
    lo, hi = _span(trace, offs, cnt, "tokens/absmax")
    if hi <= lo:
        return None
    return Block(lo, trace._f["tokens/absmax"][lo:hi].astype(np.float32, copy=False))


def read_channel_slice(trace: Trace, off: int, n: int) -> tuple[np.ndarray, np.ndarray] | None:
    """One record's channel ranges, by offset (used for trends over earlier steps)."""
    if off < 0 or n <= 0:
        return None
    if off + n > min(_dataset_len(trace, "channels/min"), _dataset_len(trace, "channels/max")):
        raise TraceFormatError(f"{trace.path}: channel range at {off} (+{n}) out of bounds")
    return (trace._f["channels/min"][off:off + n].astype(np.float32, copy=False),
            trace._f["channels/max"][off:off + n].astype(np.float32, copy=False))


def channel_absmax(cmin: np.ndarray, cmax: np.ndarray) -> np.ndarray:
    """max(|min|, |max|) per channel; channels with no finite value count as 0."""
    a = np.fmax(np.abs(cmin.astype(np.float64)), np.abs(cmax.astype(np.float64)))
    return np.where(np.isfinite(a), a, 0.0)


def first_occurrence(recs: pd.DataFrame) -> pd.DataFrame:
    """Keep the first call of each (module, io, slot) in a step (a module may run twice)."""
    return recs.drop_duplicates(subset=["module_id", "io", "slot"], keep="first")
