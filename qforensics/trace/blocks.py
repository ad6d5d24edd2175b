"""One call, one read: the per-channel ranges and per-token maxima of a set of records.

The records of one step store their per-channel (min, max) and per-token absmax in contiguous
spans of /channels/min, /channels/max and /tokens/absmax. `Trace.channel_block(recs)` reads each
span once (bounds checked, guarded) and hands back a `ChannelBlock` that answers by record row;
no caller ever sees or adds up an offset. No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import h5py
import numpy as np

from qforensics.errors import TraceFormatError, TraceUnreadableError
from qforensics.trace import schema
from qforensics.trace.table import Table
from qforensics.trace.validate import checked_span, read, valid_spans

_H5_ERRORS = (OSError, RuntimeError, KeyError, ValueError)

__all__ = ["ChannelAccess", "ChannelBlock", "frame_columns", "plan_spans"]


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


def frame_columns(recs: Any, tokens: bool = True) -> tuple[np.ndarray, ...]:
    """(row, chan_offset, channels, tok_offset, tok_count) of records (a `Table` from
    `record_table()` or a DataFrame from `records()`); without `tokens`, token offsets of -1
    (nothing to read)."""
    def col(name: str) -> np.ndarray:
        return np.asarray(recs[name], dtype=np.int64)

    rows = col("row")
    none = np.full(len(rows), -1, np.int64)
    return (rows, col("chan_offset"), col("channels"),
            col("tok_offset") if tokens else none, col("tok_count") if tokens else none)


class ChannelAccess:
    """The per-channel and per-token reads of `Trace` (a mixin: `Trace` provides the file,
    the array lengths and the record table)."""

    path: str
    _lengths: dict[str, int]
    _ring: Any  # trace.ring.RingIndex, provided by Trace

    def _ds(self, path: str) -> h5py.Dataset:  # provided by Trace
        raise NotImplementedError

    def _read_table(self, table: str, columns: list, start: int = 0, stop: int | None = None,
                    fields: list[str] | None = None) -> dict[str, np.ndarray]:
        raise NotImplementedError  # provided by Trace

    _rec_cols: dict[str, np.ndarray]  # whole-trace record columns kept by Trace

    def record_table(self, step: int | None = None, **kw: Any) -> Table:
        raise NotImplementedError  # provided by Trace

    def channel_span(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Per-channel (min, max) values [lo, hi) of the flat arrays as float32, bounds-checked:
        one read for the records of a whole step (their slices are contiguous)."""
        n = min(self._lengths["channels/min"], self._lengths["channels/max"])
        if int(lo) >= n and int(hi) > int(lo):  # format 1.1: a block still in the ring
            try:
                got = self._ring.read(int(lo), int(hi))
            except _H5_ERRORS as exc:
                raise TraceUnreadableError(f"{self.path}: /ring [{lo}, {hi}) ({exc})") from None
            if got is None:
                raise TraceUnreadableError(f"{self.path}: ring addresses [{lo}, {hi}) are not one slot")
            return got[0].astype(np.float32), got[1].astype(np.float32)
        lo, hi = checked_span(lo, int(hi) - int(lo), n, f"{self.path}: /channels")
        return (read(self._ds("channels/min"), slice(lo, hi), self.path).astype(np.float32),
                read(self._ds("channels/max"), slice(lo, hi), self.path).astype(np.float32))

    def token_span(self, lo: int, hi: int) -> np.ndarray:
        """Per-token absmax values [lo, hi) as float32, bounds-checked."""
        n = self._lengths["tokens/absmax"]
        lo, hi = checked_span(lo, int(hi) - int(lo), n, f"{self.path}: /tokens/absmax")
        return read(self._ds("tokens/absmax"), slice(lo, hi), self.path).astype(np.float32)

    def channel_block(self, recs: Any, tokens: bool = True) -> ChannelBlock:
        """Per-channel (min, max) and per-token absmax of the records in `recs` (rows of
        `records()`, usually one step's), each array read in one bounds-checked call."""
        rows, coff, ccnt, toff, tcnt = frame_columns(recs, tokens)
        n_chan = min(self._lengths["channels/min"], self._lengths["channels/max"])
        n_chan += self._ring.slots * self._ring.width  # ring addresses follow the flat arrays
        chan, clo, chi = plan_spans(f"{self.path}: /channels", rows, coff, ccnt, n_chan)
        tok, tlo, thi = plan_spans(f"{self.path}: /tokens/absmax", rows, toff, tcnt,
                                   self._lengths["tokens/absmax"])
        block = ChannelBlock(chan_lo=clo, tok_lo=tlo, _chan=chan, _tok=tok)
        if chi > clo:
            block.cmin, block.cmax = self.channel_span(clo, chi)
        if thi > tlo:
            block.tok = self.token_span(tlo, thi)
        return block

    def step_block(self, step: int) -> ChannelBlock:
        """`channel_block` of every record of one step."""
        return self.channel_block(self.record_table(step))

    def channel_ranges(self, row: int | Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray] | None:
        """Per-channel (min, max) of one record as float32, or None when not stored. `row` is
        a record row, or a record (a row of `record_table()` or of `records()`)."""
        rec = self._record(row)
        off, n = int(rec["chan_offset"]), int(rec["channels"])
        if off < 0:
            return None
        limit = (min(self._lengths["channels/min"], self._lengths["channels/max"])
                 + self._ring.slots * self._ring.width)  # ring addresses follow the flat arrays
        lo, hi = checked_span(off, n, limit, f"{self.path}: record {rec['row']} channels")
        return self.channel_span(lo, hi)

    def token_absmax(self, row: int | Mapping[str, Any]) -> np.ndarray | None:
        rec = self._record(row)
        off, n = int(rec["tok_offset"]), int(rec["tok_count"])
        if off < 0:
            return None
        lo, hi = checked_span(off, n, self._lengths["tokens/absmax"],
                              f"{self.path}: record {rec['row']} tokens")
        return self.token_span(lo, hi)

    def _record(self, row: Any) -> dict[str, Any]:
        fields = ("chan_offset", "channels", "tok_offset", "tok_count")
        if not isinstance(row, (int, np.integer)):  # a record: a dict or a pandas Series
            return {"row": row.get("row", -1), **{k: row[k] for k in fields}}
        row = int(row)
        if not 0 <= row < self._lengths["records"]:
            raise TraceFormatError(f"{self.path}: no record row {row}")
        kept = self._rec_cols
        if all(k in kept and row < len(kept[k]) for k in fields):
            return {"row": row, **{k: kept[k][row] for k in fields}}
        d = self._read_table("records", schema.RECORD_COLUMNS, row, row + 1, list(fields))
        return {"row": row, **{k: v[0] for k, v in d.items()}}

    def channels_for(self, module: str, step: int, io: int = schema.IO_INPUT,
                     slot: int = 0) -> tuple[np.ndarray, np.ndarray] | None:
        """Per-channel (min, max) of `module`'s input (or output) at `step` (first call)."""
        t = self.record_table(step)
        hit = np.nonzero((t["module"] == module) & (t["io"] == io) & (t["slot"] == slot))[0]
        if not len(hit):
            return None
        return self.channel_ranges(int(t["row"][hit[0]]))
