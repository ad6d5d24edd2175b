"""Reading compiled mode's ring on the host: a step's records, token maxima and channel ranges
out of its slot of hooks/graphstats.py's ring, in the layout of assemble.assemble_records.

`RingReader` is a mixin that GraphStats inherits (`gs.collect`, `gs.collect_many`,
`gs.read_ranges`, `gs.ranges`); the ring, its entries and a GPU's pinned host copies of each
step's slot (`start_copy`, `_host_slot`) are GraphStats'. This module reads them, never
writes them, and never imports graphstats (graphstats imports it).
- The host reads a step's slot once (`collect`): on the CPU numpy views of the ring, on a GPU
  its host copy (`_rows`, `_tok_slot`). Columns fixed once the graph is traced are arrays
  computed once (`_index`); several steps are read in one pass (`collect_many`).
- The kept channel ranges, one span per entry, are copied side by side by one call of
  fused_reduce.c's `qf_spans` (`_spans`): at once, or, with `lazy`, only when a batch needs
  them (hooks/ringranges.py, through `read_ranges`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from qforensics.hooks import fused
from qforensics.hooks.ringranges import SlotRanges
from qforensics.hooks.statsop import COL, N_SCAL, STAMP_MOD
from qforensics.trace import schema

if TYPE_CHECKING:
    import torch


class RingReader:
    """The host's reading of a GraphStats' ring (GraphStats inherits it)."""

    # the ring's, set by GraphStats (hooks/graphstats.py)
    entries: list[Any]  # graphstats.Entry, in call order
    outside: dict[int, int]  # modules recorded outside the graph -> rank
    toks: "torch.Tensor"  # the token maxima ring, [slots, rows, entries]
    copies: bool  # a GPU's way: each step's slot read from its host copy
    lazy: bool  # channel ranges left in the slot until a batch needs them
    segments: list["torch.Tensor"]  # the ring: [slots, floats] each
    _used: list[int]  # floats placed in each segment's row
    slots: int
    host_slots: int
    _copied: dict[int, int]  # host slot -> the step its copy holds
    _tok_copied: dict[int, int]  # host slot -> token rows its copy holds
    _event: dict[int, Any]  # host slot -> the event of its copy (a CUDA event)
    _first_host: dict[int, "torch.Tensor"]  # host slot -> the first-failure word it copied
    _first_np: dict[int, np.ndarray]  # the same, numpy views (a read costs no dispatch)
    # host slot -> a step's input ids and their count, its last logits row and its length
    _ids: dict[int, "torch.Tensor"]
    ids_n: dict[int, int]
    _lrow: dict[int, "torch.Tensor"]
    _lrow_n: dict[int, int]
    # a step's host copy (a GPU): its segments' rows, logits figures, input ids, token rows
    _host_slot: Callable[[int], list[np.ndarray]]
    call_order: Callable[[], list[tuple[Any, ...]]]
    # this reader's caches, reset by GraphStats when an entry is placed
    _idx: dict[str, Any] | None
    _gathers: dict[bytes, Any]

    def copied_first(self, step: int) -> int | None:
        """The op's first-failure word as `step`'s copy saw it, once that copy is done (an
        event query: never a wait); None while it is not, or when the slot holds another
        step. A GPU's way to notice a failure a step late without a sync."""
        hs = step % self.host_slots
        ev = self._event.get(hs)
        if self._copied.get(hs) != step or ev is None or not ev.query():
            return None
        return int(self._first_np[hs][0])

    def step_extras(self, step: int) -> "tuple[torch.Tensor | None, np.ndarray]":
        """The last logits row (a host tensor; None: the step had none) and the input ids put
        for `step` (GraphStats.put_step_extras); on a GPU once its copy is done."""
        hs = step % self.host_slots
        if self.copies:
            self._host_slot(step)  # its event covers the row's and the ids' copies
        n = self.ids_n.get(hs, 0)
        ids = self._ids[hs][:n].numpy().astype(np.int64) if n else np.zeros(0, np.int64)
        k = self._lrow_n.get(hs, 0)
        return (self._lrow[hs][:k] if k else None), ids

    def _rows(self, step: int) -> list[np.ndarray]:
        """This step's slot of each segment, as numpy arrays (views on CPU)."""
        slot = step % self.slots
        if not self.copies:
            return [seg[slot, :used].numpy() for seg, used in zip(self.segments, self._used)]
        return self._host_slot(step)[:len(self.segments)]

    def _tok_slot(self, step: int) -> np.ndarray:
        """This step's token maxima, [rows, entries]: on CPU a view of the token ring's
        slot, on a GPU the rows its host copy holds."""
        if not self.copies:
            return self.toks[step % self.toks.shape[0]].numpy()
        hs = step % self.host_slots
        host = self._host_slot(step)[-1]
        return host[:self._tok_copied[hs] * self.toks.shape[2]].reshape(
            -1, self.toks.shape[2])

    def _index(self) -> dict[str, Any]:
        """Per entry, fixed once the graph is traced: its segment, where its scalars, channel
        ranges and token maxima start in its segment's row, its caps."""
        if self._idx is None:
            ents = self.entries
            seg = np.array([e.seg for e in ents], np.int64)
            off = np.array([e.off for e in ents], np.int64)
            cap = np.array([e.cap for e in ents], np.int64)
            mid = np.array([e.mid for e in ents], np.int64)
            self._idx = {"seg": seg, "off": off, "cap": cap,
                         "tok": np.array([e.tok for e in ents], np.int64),
                         "chan": np.array([e.chan for e in ents], bool),
                         "scal": off[:, None] + np.arange(N_SCAL),
                         "seg_scal": seg[:, None].repeat(N_SCAL, 1),
                         "mid": mid, "io": np.array([e.io for e in ents], np.int64),
                         "slot": np.array([e.slot for e in ents], np.int64),
                         "dtype": np.array([e.dtype for e in ents], np.int64),
                         "flags": np.array([schema.FLAG_NONFLOAT if e.nonfloat else 0
                                            for e in ents], np.int64),
                         "outside": -1}
            self._gathers = {}
        return self._idx

    def _rank(self, ix: dict[str, Any]) -> np.ndarray:
        """Each entry's call in a step's call order (its call index less the step's first):
        the compiled calls first, then those outside the graph, each in the order their
        entries were placed (a call: a module's run, `Entry.call`);
        recomputed only when an entry is placed or a module is first recorded outside."""
        if ix["outside"] != len(self.outside):
            order = {c: i for i, c in enumerate(self.call_order())}
            for e in self.entries:  # their calls come after the compiled ones
                if e.mid in self.outside:
                    order.setdefault((e.mid, e.call), len(order))
            ix["rank"] = np.array([order[(e.mid, e.call)] for e in self.entries], np.int64)
            ix["outside"] = len(self.outside)
        return ix["rank"]

    def _scalars(self, rows: list[np.ndarray], ix: dict[str, Any]) -> np.ndarray:
        """Every entry's scalars in a step's `rows`; an entry placed after the rows were copied
        (a GPU's host copy, made at the step's end) reads stamp -1: it did not run then."""
        lens = np.array([len(r) for r in rows], np.int64)
        fits = ix["off"] + N_SCAL <= lens[ix["seg"]]
        if fits.all():
            return self._take(rows, ix["seg_scal"], ix["scal"])
        out = np.full((len(fits), N_SCAL), -1.0, np.float32)
        if fits.any():
            out[fits] = self._take(rows, ix["seg_scal"][fits], ix["scal"][fits])
        return out

    def _take(self, rows: list[np.ndarray], seg: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """Values at `idx` of segment `seg` (per element) across the segments' rows. Entries
        are placed segment after segment (`place`), and every gather here runs in entry order,
        so `seg` never decreases: each segment's part is one run, taken without a mask."""
        if len(rows) == 1:
            return rows[0].take(idx)  # np.take: ~3x faster than fancy indexing here
        out = np.empty(idx.shape, np.float32)
        flat_seg, flat_idx, flat_out = seg.reshape(-1), idx.reshape(-1), out.reshape(-1)
        cuts = np.searchsorted(flat_seg, np.arange(len(rows) + 1))
        for s, r in enumerate(rows):
            a, b = int(cuts[s]), int(cuts[s + 1])
            if b > a:
                np.take(r, flat_idx[a:b], out=flat_out[a:b])
        return out

    def collect(self, step: int, first_call: int, keep_channels: bool) -> dict[str, Any] | None:
        """This step's records (in call order, call indices from `first_call`), channel and
        token arrays, in the layout of assemble.assemble_records; None when no entry ran."""
        return self.collect_many([(step, first_call, keep_channels)])[0]

    def collect_many(self, items: list[tuple[int, int, bool]]) -> list[dict[str, Any] | None]:
        """`collect` of several steps, (step, first_call, keep_channels) each, in one pass: the
        steps' scalars side by side, every figure computed once over all of them (a decode
        step's ~500 entries make each numpy call cheap, so its fixed cost is what a step pays;
        the drainer, when behind, and the CPU's sync path hand several steps at once). Each
        step's part views one slice of the shared arrays."""
        if not self.entries or not items:
            return [None] * len(items)
        ix = self._index()
        steps = np.array([it[0] for it in items], np.int64)
        rows = [self._rows(int(s)) for s in steps]
        s_all = np.stack([self._scalars(r, ix) for r in rows])
        stamps = (steps % STAMP_MOD).astype(np.float32)
        ran_k, ran = np.nonzero(s_all[:, :, COL["stamp"]] == stamps[:, None])
        out: list[dict[str, Any] | None] = [None] * len(items)
        if not len(ran):
            return out
        rec = np.zeros(len(ran), dtype=schema.record_dtype())
        mids = ix["mid"][ran]
        firsts = np.array([it[1] for it in items], np.int64)
        rec["call_index"] = firsts[ran_k] + self._rank(ix)[ran]
        rec["step"] = steps[ran_k]
        rec["module_id"] = mids
        for col in ("io", "slot", "dtype", "flags"):
            rec[col] = ix[col][ran]
        s = s_all[ran_k, ran].astype(np.float64)
        rows_n = s[:, COL["rows"]].astype(np.int64)
        width = s[:, COL["channels"]].astype(np.int64)
        nonfin = s[:, COL["nonfinite"]].astype(np.int64)
        nan = s[:, COL["nan"]].astype(np.int64)
        numel = rows_n * width
        finite = np.maximum(numel - nonfin, 1)
        with np.errstate(invalid="ignore", over="ignore"):
            mean = s[:, COL["sum"]] / finite
            var = np.maximum(s[:, COL["sumsq"]] / finite - mean * mean, 0.0)
        none = numel - nonfin <= 0  # no finite value: no finite min/max/mean
        lo = np.where(none, np.nan, s[:, COL["min"]])
        hi = np.where(none, np.nan, s[:, COL["max"]])
        rec["numel"] = numel
        rec["rows"] = rows_n
        rec["channels"] = width
        rec["min"], rec["max"] = lo, hi
        rec["mean"] = np.where(none, np.nan, mean)
        rec["std"] = np.where(none, np.nan, np.sqrt(var))
        rec["absmax"] = np.maximum(np.abs(lo), np.abs(hi))
        rec["nan_count"], rec["inf_count"] = nan, nonfin - nan
        rec["chan_offset"] = -1
        kept_all = ix["chan"][ran] & (width <= ix["cap"][ran]) & (width > 1)
        toks, toff, cnt = self._tokens(steps, ran_k, ran, rows_n, ix)
        rec["tok_offset"] = toff
        rec["tok_count"] = cnt
        # each step's slice of the shared arrays (np.nonzero orders the entries step by step)
        cuts = np.searchsorted(ran_k, np.arange(len(items) + 1))
        tcuts = np.concatenate([[0], np.cumsum(cnt)])[cuts]
        for k, (step, _, keep_channels) in enumerate(items):
            a, b = int(cuts[k]), int(cuts[k + 1])
            if b == a:
                continue
            r = rec[a:b]  # a view: the step's offsets are written into the shared array
            if tcuts[k]:
                r["tok_offset"] = np.where(r["tok_offset"] >= 0, r["tok_offset"] - tcuts[k], -1)
            kept = kept_all[a:b]
            if keep_channels and kept.any():
                # channel ranges: each kept entry's minima and maxima, side by side
                spans = self._gather(ran[a:b][kept], width[a:b][kept])
                if self.lazy:  # left in the slot until a batch needs them (ringranges.py)
                    cmin, cmax = SlotRanges(self, step, spans).halves()
                else:
                    # float32 as the ring holds them (the trace's channel dtype at most): half
                    # the bytes that float64 would carry through the batch, its merge and write
                    cmin, cmax = self.ranges(rows[k], spans)
                off = np.full(b - a, -1, np.int64)
                off[kept] = np.concatenate([[0], np.cumsum(width[a:b][kept])[:-1]])
                r["chan_offset"] = off
            else:
                cmin = cmax = np.zeros(0, np.float32)
            out[k] = {"records": r, "cmin": cmin, "cmax": cmax,
                      "tok": toks[int(tcuts[k]):int(tcuts[k + 1])]}
        return out

    def _tokens(self, steps: np.ndarray, ran_k: np.ndarray, ran: np.ndarray,
                rows_n: np.ndarray, ix: dict[str, Any]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Token maxima of the records (entry `ran` of step `steps[ran_k]`): each entry's first
        rows, side by side (its column of its step's token slot; on a GPU no more rows than
        the step's copy holds); with each record's offset into them and count."""
        ncol = self.toks.shape[2]
        if not self.copies:  # the token ring in place: [S, T, E], one flat view for all steps
            flat = self.toks.numpy().reshape(-1)
            t_rows = np.full(len(steps), self.toks.shape[1], np.int64)
            base = (steps % self.toks.shape[0]) * (self.toks.shape[1] * ncol)
        else:  # each step's host copy of its rows, side by side
            slots = [self._tok_slot(int(s)) for s in steps]
            t_rows = np.array([t.shape[0] for t in slots], np.int64)
            flat = np.concatenate([t.reshape(-1) for t in slots])
            base = np.concatenate([[0], np.cumsum(t_rows * ncol)[:-1]])
        cnt = np.minimum(np.minimum(rows_n, ix["tok"][ran]), t_rows[ran_k])
        toff = np.full(len(ran), -1, np.int64)
        if not cnt.any():
            return np.zeros(0, np.float32), toff, cnt
        has = cnt > 0
        c = cnt[has]
        starts = np.concatenate([[0], np.cumsum(c)[:-1]])
        r = np.arange(int(c.sum())) - np.repeat(starts, c)
        at = np.repeat(base[ran_k[has]] + ran[has], c) + r * ncol
        toff[has] = starts
        return flat.take(at), toff, cnt

    def ranges(self, rows: list[np.ndarray], spans: dict[str, Any]
               ) -> tuple[np.ndarray, np.ndarray]:
        """The kept entries' channel minima and maxima in `rows` (a slot), side by side; NaN
        for a channel without a finite value (the op leaves +inf / -inf there; the trace's
        format says NaN)."""
        lo, hi = self._spans(rows, spans, "min"), self._spans(rows, spans, "max")
        empty = lo > hi
        if empty.any():
            lo[empty] = np.nan
            hi[empty] = np.nan
        return lo, hi

    def read_ranges(self, step: int, spans: dict[str, Any]
                    ) -> tuple[np.ndarray, np.ndarray] | None:
        """`step`'s channel ranges from its slot, None when the slot no longer holds that step
        (the op has written a later one there): its entries' stamps are checked before and
        after the copy."""
        if self.copies and self._copied.get(step % self.host_slots) != step:
            return None  # its pinned copy holds a later step now
        rows = self._rows(step)
        stamp = float(step % STAMP_MOD)
        at = spans.get("stamp_at")  # where the kept entries' stamps lie: once per gather
        if at is None:
            at = spans["stamp_at"] = spans["min"] - N_SCAL + COL["stamp"]
        if not (self._take(rows, spans["seg"], at) == stamp).all():
            return None
        got = self.ranges(rows, spans)
        if not (self._take(rows, spans["seg"], at) == stamp).all():
            return None
        return got

    def _gather(self, sel: np.ndarray, widths: np.ndarray) -> dict[str, Any]:
        """Each kept entry's segment, where its minima and its maxima start in its segment's
        row, and its width; the same entries and widths come back every step, so they are
        computed once."""
        key = sel.tobytes() + widths.tobytes()
        got = self._gathers.get(key)
        if got is None:
            ix = self._index()
            starts = ix["off"][sel] + N_SCAL
            got = self._gathers[key] = {"seg": ix["seg"][sel], "min": starts,
                                        "max": starts + ix["cap"][sel], "width": widths.copy(),
                                        "total": int(widths.sum())}
            if len(self._gathers) > 64:
                self._gathers = {key: got}
        return got

    @staticmethod
    def _spans(rows: list[np.ndarray], g: dict[str, Any], which: str) -> np.ndarray:
        """The kept entries' minima (which="min") or maxima ("max"), side by side, each a
        contiguous span of its segment's row: one call of fused_reduce.c's `qf_spans` (a
        memcpy per span), else a slice per entry."""
        fn = fused.REDUCER.spans()
        if fn is None:
            return np.concatenate([rows[s][a:a + w] for s, a, w in zip(
                g["seg"].tolist(), g[which].tolist(), g["width"].tolist())])
        # (address, count) per span: fixed for a slot's rows (the ring's, or its pinned copy),
        # so built once per slot and reused every step
        bases = tuple(r.ctypes.data for r in rows)
        descs = g.setdefault("descs", {})
        desc = descs.get((which, bases))
        if desc is None:
            if len(descs) > 16:  # rows reallocated (a segment added): drop the old ones
                descs.clear()
            desc = descs[(which, bases)] = np.empty((len(g["width"]), 2), np.int64)
            desc[:, 0] = np.array(bases, np.int64)[g["seg"]] + 4 * g[which]  # float32 rows
            desc[:, 1] = g["width"]
        out = np.empty(g["total"], np.float32)  # the step's batch keeps it
        fn(len(desc), desc.ctypes.data, out.ctypes.data)
        return out
