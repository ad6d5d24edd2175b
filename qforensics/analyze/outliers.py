"""Outlier channels: channels of a module's input whose absmax stands out (ratio to the module's
median channel absmax, an absolute threshold, the FP8/FP16 overflow limits), their trend over
earlier steps, and hidden dims that stand out in many modules (persistent / massive activations).
All per-channel math is vectorized numpy; no loop over channels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from qforensics.analyze.findings import OutlierChannel, PersistentOutlier, TrendPoint
from qforensics.analyze.thresholds import Thresholds
from qforensics.formats import FORMAT_LIMITS, GEMM_KINDS, KIND_BLOCK
from qforensics.trace import schema
from qforensics.trace.blocks import ChannelBlock
from qforensics.trace.reader import Trace
from qforensics.trace.table import Table

__all__ = [
    "ChannelRow",
    "RecordIndex",
    "StepChannels",
    "find_outlier_channels",
    "find_persistent_outliers",
    "load_step_channels",
    "standing_out",
    "top_ratio_rows",
]

_TINY = 1e-30


@dataclass
class ChannelRow:
    """One record with its per-channel absmax (and per-token absmax when stored)."""

    rec: dict[str, Any]  # the record (a row of `Trace.record_table`)
    module: str
    kind: str
    absmax: np.ndarray  # (C,) float64
    tokens: np.ndarray | None  # (T,) float32

    @cached_property
    def median(self) -> float:  # absmax is never changed after the row is made
        return float(np.median(self.absmax)) if len(self.absmax) else 0.0

    @property
    def ratio(self) -> np.ndarray:
        return self.absmax / max(self.median, _TINY)


@dataclass
class StepChannels:
    """The channel data of one step: input records (io 0, slot 0, first call of each module)."""

    step: int
    rows: list[ChannelRow] = field(default_factory=list)
    by_row: dict[int, ChannelRow] = field(default_factory=dict)  # record row -> data

    def gemm_rows(self) -> list[ChannelRow]:
        return [r for r in self.rows if r.kind in GEMM_KINDS]


def load_step_channels(trace: Trace, step: int, recs: Table,
                       extra_rows: list[int] = ()) -> StepChannels:  # type: ignore[assignment]
    """Read the channel ranges (one span) and token absmax (one span) of a step's records."""
    kinds = trace.module_kinds
    pos = np.nonzero((recs["chan_offset"] >= 0) & (recs["io"] == schema.IO_INPUT)
                     & (recs["slot"] == 0))[0]
    _, first = np.unique(recs["module_id"][pos], return_index=True)  # first record per module
    pos = pos[np.sort(first)]
    pos = pos[np.isin(kinds[recs["module_id"][pos]], GEMM_KINDS + (KIND_BLOCK,))]
    if len(extra_rows):
        more = np.nonzero(np.isin(recs["row"], list(extra_rows)) & (recs["chan_offset"] >= 0))[0]
        pos = np.concatenate([pos, more])
        _, first = np.unique(recs["row"][pos], return_index=True)  # first of each row
        pos = pos[np.sort(first)]
    out = StepChannels(step)
    if not len(pos):
        return out
    sel = recs.take(pos)
    block = trace.channel_block(sel)
    for i in range(len(sel)):
        rec = sel.row(i)
        out.rows.append(_row(rec, kinds, block))
        out.by_row[int(rec["row"])] = out.rows[-1]
    return out


def channel_absmax(cmin: np.ndarray, cmax: np.ndarray) -> np.ndarray:
    """max(|min|, |max|) per channel; channels with no finite value count as 0."""
    a = np.fmax(np.abs(cmin.astype(np.float64)), np.abs(cmax.astype(np.float64)))
    return np.where(np.isfinite(a), a, 0.0)


def _row(rec: dict[str, Any], kinds: np.ndarray, block: ChannelBlock) -> ChannelRow:
    row = int(rec["row"])
    got = block.channels(row)
    assert got is not None  # `sel` holds only records that store channel ranges
    return ChannelRow(rec, str(rec["module"]), str(kinds[int(rec["module_id"])]),
                      channel_absmax(*got), block.tokens(row))


def _limits(a: np.ndarray, r: np.ndarray, th: Thresholds) -> np.ndarray:
    """(n, 5) bool matrix: ratio, absolute, fp8-e4m3, fp8-e5m2, fp16."""
    return np.stack([r >= th.ratio, a >= th.absolute, a > FORMAT_LIMITS["fp8-e4m3"],
                     a > FORMAT_LIMITS["fp8-e5m2"], a > FORMAT_LIMITS["fp16"]], axis=-1)


_LIMIT_NAMES = np.array(["ratio", "absolute", "fp8-e4m3", "fp8-e5m2", "fp16"])


class RecordIndex:
    """Narrow record columns over the whole trace (read once, lazily), to find one module's
    record in earlier steps without reading those steps' records."""

    def __init__(self, trace: Trace) -> None:
        self._trace = trace
        self._cols: dict[str, np.ndarray] | None = None

    @property
    def cols(self) -> dict[str, np.ndarray]:
        if self._cols is None:
            self._cols = self._trace.record_columns(["step", "module_id", "io", "slot"])
        return self._cols

    def rows_of(self, module_id: int, io: int, slot: int) -> dict[int, int]:
        """step -> first record row of this (module, io, slot)."""
        c = self.cols
        hit = np.nonzero((c["module_id"] == module_id) & (c["io"] == io) & (c["slot"] == slot))[0]
        steps = c["step"][hit]
        _, first = np.unique(steps, return_index=True)
        return {int(c["step"][hit[i]]): int(hit[i]) for i in first}


def _trend(trace: Trace, index: RecordIndex, row: ChannelRow, channels: np.ndarray,
           th: Thresholds) -> tuple[list[list[TrendPoint]], list[int | None]]:
    step = int(row.rec["step"])
    by_step = index.rows_of(int(row.rec["module_id"]), int(row.rec["io"]), int(row.rec["slot"]))
    earlier = sorted(s for s in by_step if s < step)
    if len(earlier) > th.trend_steps:
        pick = np.unique(np.linspace(0, len(earlier) - 1, max(int(th.trend_steps), 2)).round()
                         .astype(int))
        earlier = [earlier[i] for i in pick]
    pts: list[list[TrendPoint]] = [[] for _ in channels]
    first: list[int | None] = [None] * len(channels)
    for s in earlier + [step]:
        if s == step:
            a, r = row.absmax[channels], row.ratio[channels]
        else:
            got = trace.channel_ranges(by_step[s])
            if got is None or len(got[0]) != len(row.absmax):
                continue
            full = channel_absmax(*got)
            med = max(float(np.median(full)), _TINY)
            a, r = full[channels], full[channels] / med
        hot = _limits(a, r, th)[:, :2].any(axis=1) | (a > FORMAT_LIMITS["fp8-e4m3"])
        for k in range(len(channels)):
            pts[k].append(TrendPoint(int(s), float(a[k]), float(r[k])))
            if first[k] is None and hot[k]:
                first[k] = int(s)
    return pts, first


def _ranked(a: np.ndarray, lim: np.ndarray) -> np.ndarray:
    """Channels past any limit, largest absmax first."""
    hot = np.nonzero(lim.any(axis=1))[0]
    return hot[np.argsort(-a[hot], kind="stable")]


def standing_out(absmax: np.ndarray, th: Thresholds) -> np.ndarray:
    """Channels of one record's absmax (as `channel_absmax` gives it) that stand out by any
    limit (ratio to the median channel, absolute, a format's overflow), largest first."""
    a = np.asarray(absmax, np.float64)
    if not a.size:
        return np.zeros(0, np.int64)
    med = max(float(np.median(a)), _TINY)
    return _ranked(a, _limits(a, a / med, th))


def outliers_of_row(trace: Trace, row: ChannelRow, th: Thresholds, index: RecordIndex | None,
                    limit: int) -> list[OutlierChannel]:
    a, r = row.absmax, row.ratio
    lim = _limits(a, r, th)
    hot = _ranked(a, lim)[:limit]
    if not len(hot):
        return []
    token = None
    if row.tokens is not None and len(row.tokens):
        t = np.where(np.isfinite(row.tokens), row.tokens, -np.inf)
        token = int(np.argmax(t))
    if index is not None:
        trend, first = _trend(trace, index, row, hot, th)
    else:
        trend, first = [[] for _ in hot], [None] * len(hot)
    med = row.median
    return [OutlierChannel(
        module=row.module, step=int(row.rec["step"]), call_index=int(row.rec["call_index"]),
        io=int(row.rec["io"]), channel=int(c), absmax=float(a[c]),
        ratio_to_median=float(r[c]), median_absmax=med, channels_total=len(a), token=token,
        token_is_peak_proxy=True, first_step=first[k], trend=trend[k],
        limits=_LIMIT_NAMES[lim[c]].tolist()) for k, c in enumerate(hot)]


def find_outlier_channels(trace: Trace, rows: list[ChannelRow], th: Thresholds,
                          index: RecordIndex | None) -> list[OutlierChannel]:
    """Standing-out channels of the given records, largest absmax first, at most `th.top`."""
    out: list[OutlierChannel] = []
    for row in rows:
        out.extend(outliers_of_row(trace, row, th, index, int(th.top)))
    out.sort(key=lambda o: -o.absmax)
    return out[:int(th.top)]


def top_ratio_rows(sc: StepChannels, n: int) -> list[ChannelRow]:
    """The linear modules whose input has the largest channel ratio (at least one channel
    standing out is not required here; the caller's thresholds decide)."""
    rows = sc.gemm_rows()
    _medians(rows)
    rows = sorted(rows, key=lambda r: -float(r.ratio.max()) if len(r.absmax) else 0.0)
    return rows[:n]


def _medians(rows: list[ChannelRow]) -> None:
    """Fill each row's cached median with one numpy call per input width (the same values as
    row by row: the median of each row of the stacked matrix)."""
    by_width: dict[int, list[ChannelRow]] = {}
    for r in rows:
        if len(r.absmax) and "median" not in r.__dict__:
            by_width.setdefault(len(r.absmax), []).append(r)
    for grp in by_width.values():
        if len(grp) > 1:
            for r, m in zip(grp, np.median(np.stack([r.absmax for r in grp]), axis=1).tolist()):
                r.__dict__["median"] = m


def find_persistent_outliers(sc: StepChannels, th: Thresholds) -> list[PersistentOutlier]:
    """Hidden-dim indices whose ratio reaches `th.ratio` in at least `th.persistent_min_modules`
    module inputs of the same width (vectorized over modules x channels per width)."""
    by_width: dict[int, list[ChannelRow]] = {}
    for r in sc.rows:
        if r.kind in GEMM_KINDS + (KIND_BLOCK,) and len(r.absmax):
            by_width.setdefault(len(r.absmax), []).append(r)
    out: list[PersistentOutlier] = []
    for rows in by_width.values():
        if len(rows) < th.persistent_min_modules:
            continue
        a = np.stack([r.absmax for r in rows])  # (M, C)
        med = np.maximum(np.median(a, axis=1, keepdims=True), _TINY)
        ratio = a / med
        hot = ratio >= th.ratio
        count = hot.sum(axis=0)
        dims = np.nonzero(count >= max(int(th.persistent_min_modules), 1))[0]
        for d in dims[np.argsort(-count[dims], kind="stable")]:
            who = np.nonzero(hot[:, d])[0]
            who = who[np.argsort(-ratio[who, d], kind="stable")]
            out.append(PersistentOutlier(
                dim=int(d), modules=int(count[d]), modules_checked=len(rows),
                max_absmax=float(a[who, d].max()), max_ratio=float(ratio[who, d].max()),
                examples=[rows[i].module for i in who[:3]]))
    out.sort(key=lambda p: (-p.modules, -p.max_ratio))
    return out[:int(th.top)]
