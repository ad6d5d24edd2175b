"""One call, one read: the per-channel ranges and per-token maxima of a set of records.

The records of one step store their per-channel (min, max) and per-token absmax in contiguous
spans of /channels/min, /channels/max and /tokens/absmax. `Trace.channel_block(recs)` reads each
span once (bounds checked, guarded) and hands back a `ChannelBlock` that answers by record row;
no caller ever sees or adds up an offset. No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from qforensics.errors import TraceUnreadableError
from qforensics.trace.validate import valid_spans

__all__ = ["ChannelBlock", "frame_columns", "plan_spans"]


@dataclass
class ChannelBlock:
    """Channel and token data of some records (usually one step's), keyed by record row."""

    chan_lo: int = 0
    cmin: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    cmax: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    tok_lo: int = 0
    tok: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    _chan: dict[int, tuple[int, int]] = field(default_factory=dict)  # row -> (start, count)
    _tok: dict[int, tuple[int, int]] = field(default_factory=dict)

    @property
    def rows(self) -> list[int]:
        """Record rows with per-channel ranges stored."""
        return list(self._chan)

    def channels(self, row: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(min, max) per channel of record `row` as float32 views, or None when not stored."""
        got = self._chan.get(int(row))
        if got is None:
            return None
        i, n = got[0] - self.chan_lo, got[1]
        return self.cmin[i:i + n], self.cmax[i:i + n]

    def tokens(self, row: int) -> np.ndarray | None:
        """Absmax per token of record `row` as float32, or None when not stored."""
        got = self._tok.get(int(row))
        if got is None:
            return None
        i, n = got[0] - self.tok_lo, got[1]
        return self.tok[i:i + n]


def plan_spans(where: str, rows: np.ndarray, offsets: np.ndarray, counts: np.ndarray,
               limit: int) -> tuple[dict[int, tuple[int, int]], int, int]:
    """Validated (row -> (offset, count)) for rows that store data (offset >= 0), and the one
    span [lo, hi) covering them all. A stored span out of bounds is damage: refused by name."""
    rows = np.asarray(rows, dtype=np.int64)
    off = np.asarray(offsets, dtype=np.int64)
    n = np.asarray(counts, dtype=np.int64)
    stored = off >= 0
    ok = valid_spans(off, n, limit)
    bad = stored & ~ok
    if bad.any():
        i = int(np.argmax(bad))
        raise TraceUnreadableError(f"{where}: record {int(rows[i])} points past the data "
                                   f"(offset {int(off[i])}, count {int(n[i])}, the array holds "
                                   f"{int(limit)})")
    if not stored.any():
        return {}, 0, 0
    o, c, r = off[stored], n[stored], rows[stored]
    spans = {int(a): (int(b), int(d)) for a, b, d in zip(r, o, c)}
    return spans, int(o.min()), int((o + c).max())  # o + c <= limit: no wrap


def frame_columns(recs: pd.DataFrame, tokens: bool = True) -> tuple[np.ndarray, ...]:
    """(row, chan_offset, channels, tok_offset, tok_count) of a records frame; without
    `tokens`, token offsets of -1 (nothing to read)."""
    rows = recs["row"].to_numpy(np.int64)
    none = np.full(len(rows), -1, np.int64)
    return (rows, recs["chan_offset"].to_numpy(np.int64), recs["channels"].to_numpy(np.int64),
            recs["tok_offset"].to_numpy(np.int64) if tokens else none,
            recs["tok_count"].to_numpy(np.int64) if tokens else none)
