"""One byte budget for a capture of any length (format 1.2): what `TraceWriter` keeps once the
budget is reached, and the room it holds back for it from the start.

- `/summary`: every step's summary, in a fixed number of rows allocated at creation
  (trace/summary.py consolidates old rows when room is needed); written every drain.
- The ring: the last K steps' channel blocks (format 1.1) and, once full detail is no longer
  appended, their step rows, records and per-token maxima too (`/ring/steps`, `/ring/records`,
  `/ring/tokens`, `/ring/detail`), allocated at the first drain; so kill -9 keeps them.
- Pinned windows: the first non-finite step and the first step of each trigger kind, each with
  the W steps before it, appended in full detail into room held back (`_reserve`) from the
  regular appends, so they fit whenever they come; later ones while room remains, all counted
  in `/pinned` (and the summaries count every non-finite step).

A mixin of `TraceWriter` (with `ColumnWriter`); runs on the drainer only, except
`plan_budget`, which runs before the file exists and raises CaptureError when the options
cannot hold. Nothing here imports torch.
"""

from __future__ import annotations

import collections
import os
import logging
from dataclasses import replace
from typing import Any

import h5py
import numpy as np

from qforensics.errors import CaptureError
from qforensics.trace import schema
from qforensics.trace.badstep import bad_steps
from qforensics.trace.batch import StepBatch, merge_batches
from qforensics.trace.columns import put_at
from qforensics.trace.summary import Summaries, empty_rows, step_summaries, summary_capacity

log = logging.getLogger("qforensics.trace.writer")

_BASE = 1 << 20  # the file's fixed part: groups, /modules, HDF5 metadata
_SLACK = 2 << 20  # one open chunk of every appended dataset, rewritten by a pinned append
_REC_PER_MODULE = 2.2  # records a hooked module leaves per step (input and output, a few more)
_KINDS = schema.TRIGGER_KINDS


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def batch_bytes(b: StepBatch, chan_item: int) -> int:
    """The bytes one step's full detail takes in the file, uncompressed."""
    return int(b.records.nbytes + b.steps.nbytes + 2 * len(b.chan_min) * chan_item
               + 4 * len(b.tok_absmax) + 8 * len(b.input_ids))


def engine_step(b: StepBatch) -> int:
    """The step an engine-only batch belongs to (-1: none named)."""
    for t in ("steps", "rows", "sampled"):
        a = b.engine.get(t)
        if a is not None and len(a):
            return int(a["step"][0])
    return -1


def _decode(k: Any) -> str:
    return k.decode("ascii", "replace") if isinstance(k, bytes) else str(k)


class BudgetWriter:
    _cols: dict[str, h5py.Dataset]
    _len: dict[str, int]
    max_bytes: int
    capped_at: int | None
    ring_slots: int
    channel_dtype: np.dtype

    # -- before the file exists --------------------------------------------------------------
    def plan_budget(self, modules: list[dict[str, str]], options: dict[str, Any]) -> None:
        """Sizes of the fixed parts; CaptureError when max_bytes cannot hold the ring and the
        pinned windows (estimated from the hooked modules until steps are seen)."""
        self.window = max(0, int(options.get("trigger_window", 8) or 0))
        self.summary_rows = summary_capacity(self.max_bytes)
        self._summaries = Summaries(self.summary_rows)
        self._root = next((i for i, m in enumerate(modules) if m.get("kind") == "root"), -1)
        n_rec = max(8, int(_REC_PER_MODULE * len(modules)))
        item = self.channel_dtype.itemsize
        chan = 4 * getattr(self, "ring_chunk", 4096)
        self._step_est = (n_rec * (schema.record_dtype().itemsize + 4)
                          + 2 * chan * item + schema.step_dtype().itemsize)
        snap = int(options.get("snapshot_budget", 0) or 0)
        self._snap_reserve = min(snap, max(1 << 20, self.max_bytes // 32)) if snap else 0
        self._pinned: set[str] = set()
        self._warm_steps: set[int] = set()  # warm-up forwards (engine tables): never pinned
        self._held: collections.deque[StepBatch] = collections.deque(maxlen=max(1, self.window))
        # an engine's tables of a step come apart from its records (vLLM: before and after it)
        self._held_engine: collections.deque[StepBatch] = collections.deque(
            maxlen=2 * (self.window + 2))
        self.pins_kept = self.pins_dropped = 0
        self._detail_shape = (0, 0)  # (records, token values) a ring slot holds
        self.detail_off: str | None = None
        # room kept for the requests table once full detail stops: every request keeps its id
        # (about 100 bytes a request: 1 GiB keeps 16 MiB, some 160,000 requests)
        self._req_reserve = self.max_bytes // 64 if self.max_bytes else 0
        self._req_used = 0
        if not self.max_bytes:
            return
        ring = self.ring_slots * self._step_est
        need = (_BASE + self.summary_rows * schema.summary_dtype().itemsize + ring
                + self._reserve())
        if need > self.max_bytes:
            raise CaptureError(
                f"max_bytes={self.max_bytes} ({_mib(self.max_bytes)}) cannot hold what the "
                f"trace keeps in any case: the ring of the last {self.ring_slots} steps "
                f"(~{_mib(ring)}) and the pinned windows of the first failure and the first "
                f"step of each trigger kind with the {self.window} steps before each "
                f"(~{_mib(self._reserve() - self._req_reserve)}), and room for the requests "
                f"table (1/64 of the budget); give at least {_mib(need)}, or fewer ring_steps "
                "/ a smaller trigger_window")

    def _window_bytes(self, kind: str) -> int:
        extra = self._snap_reserve if kind == "nonfinite" else 0
        return (self.window + 1) * self._step_est + _SLACK + extra

    def _reserve(self, taking: tuple[str, ...] = (), requests: bool = False) -> int:
        """Bytes held back for the pinned windows not yet taken (`taking`: being taken now) and
        for the requests table (unless `requests`: appending to it now). The first failure's
        window (`nonfinite`) yields to no other kind's: their reserve is an estimate that a wide
        forward can push past what is left, and nothing may evict the first failure."""
        windows = 0 if "nonfinite" in taking else sum(
            self._window_bytes(k) for k in _KINDS if k not in self._pinned and k not in taking)
        return windows + (0 if requests else max(0, self._req_reserve - self._req_used))

    # -- file layout -------------------------------------------------------------------------
    def _create_budget(self, f: h5py.File) -> None:
        g = f.create_group("summary")
        # written whole at creation: its room is taken from the budget up front
        self._cols[schema.SUMMARY_BLOCKS] = g.create_dataset(
            "blocks", data=empty_rows(self.summary_rows))
        self._cols[schema.SUMMARY_STATE] = g.create_dataset(
            "state", data=self._summaries.state())
        k = max(self.ring_slots, 1)
        self._cols[schema.RING_STEPS] = f.create_dataset(  # written now: its room is taken
            schema.RING_STEPS, data=np.zeros(k, schema.step_dtype()))
        self._cols[schema.RING_RECORDS] = f.create_dataset(
            schema.RING_RECORDS, shape=(k, 0), maxshape=(k, None), dtype=schema.record_dtype(),
            chunks=(1, 512))
        self._cols[schema.RING_TOKENS] = f.create_dataset(
            schema.RING_TOKENS, shape=(k, 0), maxshape=(k, None), dtype="f4",
            chunks=(1, 4096))
        self._cols[schema.RING_DETAIL] = f.create_dataset(
            schema.RING_DETAIL, data=np.zeros((k, 2), np.int64))
        pin = f.create_group("pinned")
        for name, dt, _ in schema.PINNED_COLUMNS:
            self._cols[f"pinned/{name}"] = pin.create_dataset(
                name, shape=(0,), maxshape=(None,), dtype=dt, chunks=(64,))

    # -- every drain -------------------------------------------------------------------------
    def _note(self, batches: list[StepBatch]) -> None:
        """Fold the batches' summaries in and update the per-step estimate."""
        item = self.channel_dtype.itemsize
        for b in batches:  # an engine's tables of a step come before the step, on their own
            es = b.engine.get("steps")
            if es is not None and len(es) and (es["warmup"] > 0).any():
                self._warm_steps.update(es["step"][es["warmup"] > 0].tolist())
        # the windows are reserved by the size of a step that can be pinned: never a warm-up
        # forward (vLLM's on its dummy batch is thousands of rows wide)
        sizes = [batch_bytes(b, item) for b in batches
                 if not (len(b.steps) and int(b.steps["step"][0]) in self._warm_steps)]
        if sizes:
            self._step_est = max(self._step_est if self._seen_steps else 0, *sizes)
            self._seen_steps = True
        have = [b for b in batches if len(b.steps)]
        self._bad_steps: set[int] = set()
        if have:
            if len(have) == 1:
                steps = have[0].steps
            else:  # row by row: np.concatenate of structured arrays costs more than this
                steps = np.empty(sum(len(b.steps) for b in have), schema.step_dtype())
                i = 0
                for b in have:
                    steps[i:i + len(b.steps)] = b.steps
                    i += len(b.steps)
            warm = self._warm(have[0]) if len(have) == 1 else np.concatenate(
                [self._warm(b) for b in have])
            bad = (self._bad_requests(have[0]) if len(have) == 1
                   else np.concatenate([self._bad_requests(b) for b in have]))
            rows = step_summaries(steps, warm, bad)
            self._summaries.add(rows)
            if rows["nonfinite_steps"].any():
                self._bad_steps = set(rows["step_lo"][rows["nonfinite_steps"] > 0].tolist())
        if self.ring_slots and self._detail_shape == (0, 0) and self.detail_off is None:
            self._allocate_detail(batches)

    _seen_steps = False
    _bad_steps: set[int] = set()

    def _warm(self, b: StepBatch) -> np.ndarray:
        """Which of a batch's steps are warm-up forwards (never a failure to pin): flagged by
        the engine's tables, in this batch or in an engine-only batch before it."""
        es = b.engine.get("steps")
        if es is not None and len(es):
            self._warm_steps.update(es["step"][es["warmup"] > 0].tolist())
        if not self._warm_steps:
            return np.zeros(len(b.steps), bool)
        return np.isin(b.steps["step"], np.fromiter(self._warm_steps, np.int64))

    def _bad_requests(self, b: StepBatch) -> np.ndarray:
        """Requests whose logits row held NaN/Inf (an engine's root record, slot 1)."""
        out = np.zeros(len(b.steps), np.int64)
        s = b.steps
        if not bad_steps(s, count_warmup=True).any() or self._root < 0:
            return out
        r = b.records
        sel = np.nonzero((r["module_id"] == self._root) & (r["io"] == schema.IO_OUTPUT)
                         & (r["slot"] == schema.ENGINE_ROW_FLAG_SLOTS["logits"])
                         & (r["tok_offset"] >= 0))[0]
        tok = np.asarray(b.tok_absmax)
        for i in sel:
            lo, n = int(r["tok_offset"][i]), int(r["tok_count"][i])
            j = np.nonzero(s["step"] == r["step"][i])[0]
            if len(j) and lo + n <= len(tok):
                out[j[0]] += int((tok[lo:lo + n] > 0).sum())
        return out

    def _write_summary(self) -> None:
        s = self._summaries
        if s.dirty is None:
            return
        lo, hi = s.dirty
        ds = self._cols[schema.SUMMARY_BLOCKS]
        fspace = ds.id.get_space()
        fspace.select_hyperslab((lo,), (hi - lo,))
        ds.id.write(h5py.h5s.create_simple((hi - lo,)), fspace,
                    np.ascontiguousarray(s.rows[lo:hi]))
        self._cols[schema.SUMMARY_STATE][:] = s.state()
        s.dirty = None

    # -- the ring's full detail --------------------------------------------------------------
    def _allocate_detail(self, batches: list[StepBatch]) -> None:
        """Size the ring's detail rows from the first steps (x 1.25) and write them whole, so
        their room is taken now, while the budget has it."""
        n_rec = max(len(b.records) for b in batches)
        n_tok = max(len(b.tok_absmax) for b in batches)
        r = -(-max(1, n_rec * 5 // 4) // 512) * 512
        t = -(-max(1, n_tok * 5 // 4) // 4096) * 4096
        k = self._cols[schema.RING_RECORDS].shape[0]
        extra = k * (r * schema.record_dtype().itemsize + 4 * t)
        if not self._within_cap(extra + self._reserve()):
            self.detail_off = f"no room for the ring's detail ({_mib(extra)})"
            log.warning("qforensics: %s; the ring keeps channel ranges only", self.detail_off)
            return
        for path, width, dt in ((schema.RING_RECORDS, r, schema.record_dtype()),
                                (schema.RING_TOKENS, t, np.dtype("f4"))):
            ds = self._cols[path]
            ds.resize((k, width))
            ds[:, :] = np.zeros((k, width), dt)
        self._detail_shape = (r, t)

    def _ring_detail_rows(self, b: StepBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What a ring slot holds of a step: its records (as many as a slot takes), per-token
        maxima and step row."""
        r_cap, t_cap = self._detail_shape
        rec = b.records[:r_cap].copy()
        tok = np.asarray(b.tok_absmax[:t_cap], np.float32)
        rec["tok_offset"] = np.where(rec["tok_offset"] + rec["tok_count"] <= len(tok),
                                     rec["tok_offset"], -1)
        if not b.ring:  # its block is the batch's own channel arrays: offsets relative to it
            ch = rec["chan_offset"] >= 0
            rec["flags"] = np.where(ch, rec["flags"] | schema.FLAG_RING, rec["flags"])
        return rec, tok, b.steps[:1].copy()

    def _write_ring_detail(self, b: StepBatch) -> None:
        """Step row, records and per-token maxima of a step into its ring slot, then its
        channel block (the slot's step is -1 meanwhile)."""
        if not self.ring_slots or not len(b.steps):
            return
        step = int(b.steps["step"][0])
        slot = step % self.ring_slots
        put_at(self._cols["ring/step"], slot, -1)
        r_cap, _ = self._detail_shape
        rec, tok, row = self._ring_detail_rows(b)
        if r_cap:
            rd = self._cols[schema.RING_RECORDS]
            fs = rd.id.get_space()
            fs.select_hyperslab((slot, 0), (1, len(rec)))
            if len(rec):
                rd.id.write(h5py.h5s.create_simple((1, len(rec))), fs,
                            np.ascontiguousarray(rec).reshape(1, -1))
            if len(tok):
                td = self._cols[schema.RING_TOKENS]
                fs = td.id.get_space()
                fs.select_hyperslab((slot, 0), (1, len(tok)))
                td.id.write(h5py.h5s.create_simple((1, len(tok))), fs, tok.reshape(1, -1))
        sd = self._cols[schema.RING_STEPS]
        fs = sd.id.get_space()
        fs.select_hyperslab((slot,), (1,))
        sd.id.write(h5py.h5s.create_simple((1,)), fs, np.ascontiguousarray(row))
        self._cols[schema.RING_DETAIL][slot] = [len(rec) if r_cap else 0, len(tok)]
        self._write_ring(b, always=True)

    # -- pinned windows ----------------------------------------------------------------------
    def _kinds(self, b: StepBatch) -> list[str]:
        """Trigger kinds of a step: its triggers, and `nonfinite` when its summary (`_note`,
        warm-ups left out) says it held NaN/Inf."""
        kinds = [_decode(k) for k in b.triggers["kind"]] if len(b.triggers) else []
        if self._bad_steps and len(b.steps) and int(b.steps["step"][0]) in self._bad_steps:
            kinds.append("nonfinite")
        if not kinds:
            return kinds
        return [k for k in dict.fromkeys(kinds) if k in _KINDS]

    def _pin(self, batches: list[StepBatch], stripped: list[StepBatch],
             appended: list[bool]) -> None:
        """Pinned windows of the triggered steps among `batches` (`appended`: already in the
        tables, before the budget was reached)."""
        for b, sb, appended in zip(batches, stripped, appended):
            if not len(b.steps):  # an engine's tables of a step, submitted on their own
                if not appended and b.engine:
                    self._hold_engine(sb)
                continue
            kinds = self._kinds(b)
            if not kinds:
                if not appended:
                    self._held.append(sb)
                continue
            step = int(b.steps["step"][0])
            new = tuple(k for k in kinds if k not in self._pinned)
            if appended:
                if new:
                    self._pinned.update(new)
                    self._pin_rows(step, new, max(0, step - self.window), 1)
                continue
            lo = step - self.window
            # the window's engine tables (held apart) first, then its steps
            window = [e for e in self._held_engine if engine_step(e) >= lo]
            n_eng = len(window)
            window += [h for h in self._held if int(h.steps["step"][0]) >= lo]
            window.append(sb)
            self._held.clear()
            self._held_engine.clear()
            kept = self._append_pinned(window, new)
            if kept:
                self._pinned.update(kinds)
                self.pins_kept += 1
            else:
                self.pins_dropped += 1
            self._pin_rows(step, new or tuple(kinds[:1]), int(window[n_eng].steps["step"][0])
                           if kept else step, int(kept))

    def _hold_engine(self, b: StepBatch) -> None:
        """An engine's tables of one step once full detail is no longer appended: its new
        requests' rows at once while they fit (a row a request: every request keeps its id),
        the rest (the step's token rows, sampled tokens) held for a pinned window."""
        rest = dict(b.engine)
        reqs = rest.pop("requests", None)
        if reqs is not None and len(reqs):
            cols = schema.ENGINE_REQUEST_COLUMNS
            grow = self._growth({f"engine/requests/{n}": len(reqs) for n, _, _ in cols})
            # the room kept for requests first (counted by the rows' own bytes: `grow` bounds
            # a gzip chunk's rewrite, many times what a few rows add), then what windows leave
            used = len(reqs) * reqs.dtype.itemsize
            own = used <= self._req_reserve - self._req_used and self._within_cap(grow)
            if own or self._within_cap(grow + self._reserve(requests=True)):
                self._append_table("engine/requests", cols, reqs)
                self._req_used += used
            else:
                rest["requests"] = reqs
        if any(len(v) for v in rest.values()):
            self._held_engine.append(replace(b, engine=rest))

    def _append_pinned(self, window: list[StepBatch], new: tuple[str, ...]) -> bool:
        """Append a pinned window (its steps; engine-only batches of them first)."""
        reserve = self._reserve(taking=new)
        merged = merge_batches(window) if len(window) > 1 else window[0]
        tries = [merged, replace(merged, snapshots=merged.snapshots[:0],
                                 snapshot_bytes=merged.snapshot_bytes[:0])]
        if len(window) > 1:  # the triggered step alone, with its own engine tables
            step = int(window[-1].steps["step"][0])
            own = [e for e in window if not len(e.steps) and engine_step(e) == step]
            last = merge_batches([*own, window[-1]]) if own else window[-1]
            tries.append(replace(last, snapshots=last.snapshots[:0],
                                 snapshot_bytes=last.snapshot_bytes[:0]))
        for t in tries:
            if self._within_cap(self._batch_growth(t) + reserve):
                self._append_batch(t)
                return True
        if not self._told_dropped:  # once: what did not fit, for whoever sizes the budget
            self._told_dropped = True
            free = self.max_bytes - os.path.getsize(self.path)
            log.warning("qforensics: no room for the pinned window of step %d (%s): its "
                        "smallest form needs %s, %s free with %s held back for the windows "
                        "not taken yet", int(window[-1].steps["step"][0]), ",".join(new) or
                        "again", _mib(self._batch_growth(tries[-1])), _mib(free), _mib(reserve))
        return False

    _told_dropped = False
    _req_reserve = _req_used = 0

    def _pin_rows(self, step: int, kinds: tuple[str, ...], lo: int, kept: int) -> None:
        rows = np.zeros(len(kinds), schema.pinned_dtype())
        rows["step"], rows["window_lo"], rows["kept"] = step, lo, kept
        rows["kind"] = [k.encode() for k in kinds]
        if self._within_cap(self._chunk_growth("pinned/step", len(rows)) * 4):
            self._append_table("pinned", schema.PINNED_COLUMNS, rows)
