"""Capture inside compiled graphs: the stats op (hooks/statsop.py), one opaque call to
torch.compile, writes the recorded tensors' statistics into a static device ring.

Why this shape (see docs/architecture.md, "Compiled mode"):
- vLLM compiles the model once, full-graph, and drops every guard. A hook that Dynamo cannot
  trace (a C extension, `.item()`, I/O) is a graph break, which vLLM refuses: the engine dies.
  So a hook here is one op call with constant arguments, into buffers allocated before the
  first forward (at trace time) and never reallocated. Under CUDA graphs the op's kernel is
  replayed with the graph, so every replay records.
- What a hook learns in Python at trace time is frozen into the graph, on purpose:
  `graphhooks._place` (`assume_constant_result`) gives each recorded tensor its entry (a
  segment of the ring, an offset in its rows), in the order the hooks run: the call order.
- The ring: a few segments, each [R, W] float32, marked static; the op writes the row of slot
  `step % R`, `step` being a device counter the host sets before the forward (one fill, no
  sync). Each entry's row carries that step as its stamp, so the host tells an entry written
  in this step from a stale one (a module that did not run).
- The host reads the slot once per step (`GraphStats.collect`): on CPU in place (numpy views
  of the ring, no copy); on a GPU through one asynchronous device-to-host copy per segment into
  pinned buffers allocated once, started when the forward returns. Columns fixed once the
  graph is traced are arrays computed once (`_index`); the kept channel ranges, one span per
  entry, are copied side by side by one call of fused_reduce.c's `qf_spans` (`_spans`): at
  once, or, with `lazy`, only when a batch needs them (hooks/ringranges.py).
- `first`: the op's first-failure word (step, entry, NaN?) of the first call that saw a
  non-finite value (statsop.first_key); read at close into the status. `snap`: the first
  failing output's call, kept by the op (hooks/graphsnap.py).
No Python at replay; per-call figures match the eager capture's (finite values only).
"""

from __future__ import annotations

import collections
import itertools
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from qforensics.hooks import fused, statscpu, statsnative, statsop, statstriton
from qforensics.hooks.graphsnap import CompiledSnap
from qforensics.hooks.ringranges import SlotRanges
from qforensics.hooks.statsop import COL, N_SCAL, STAMP_MOD, entry_width, new_toks
from qforensics.trace import schema

log = logging.getLogger("qforensics.hooks.capture")

LOGITS_FIGURES = 18  # reduce.exact_logits' row
MAX_IDS = 65536  # input ids kept per step (as the eager capture keeps)
SEGMENT_FLOATS = 1 << 22  # one ring segment's row: 16 MiB (more for an entry wider than that)
# A GPU's device ring: the op writes a slot, which is copied to pinned host memory right after
# the step, on its stream (the host reads the copies: their number, `host_slots`, is what
# hooks/graphmode.py sizes for the steps not yet read, hooks/ringranges.py's lazy ranges
# included); the CPU's ring is read in place and has `host_slots` slots itself
RING_SLOTS = 4
# tests: the GPU's way of reading the ring (a device ring of RING_SLOTS, each step copied into
# host buffers, read from them) on the CPU, where copies are synchronous and not pinned
HOST_COPIES_ON_CPU = False
_REGISTRY: dict[int, "GraphStats"] = {}
QUEUE: list[tuple[Any, ...]] = []  # GraphStats.queue
_KEYS = itertools.count(1)


class _Done:
    """The event of a copy on the CPU (`HOST_COPIES_ON_CPU`): done when made."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _trace_id() -> tuple[Any, ...] | None:
    """Dynamo's current trace attempt: (frame, compile, attempt); the frame's id is its
    code's, the same for every compile of it. None outside a trace."""
    ctx = getattr(torch._guards, "CompileContext", None)
    get = getattr(ctx, "current_trace_id", None)
    tid = get() if get is not None else None
    if tid is None:
        return None
    cid = tid.compile_id
    return (getattr(cid, "frame_id", None), str(cid), tid.attempt)


def registered(key: int) -> "GraphStats | None":
    """The live GraphStats of `key` (a traced hook's constant), None once it closed."""
    return _REGISTRY.get(key)


@dataclass
class Entry:
    mid: int
    io: int
    slot: int
    width: int  # channels kept at most (the module's bound; 1: scalars only)
    dtype: int  # schema.DTYPE_CODES
    nonfloat: bool
    chan: bool  # per-channel min/max kept
    seg: int = 0  # its ring segment
    off: int = 0  # where its row starts in the segment
    cap: int = 1  # channel ranges it keeps (0: none)
    tok: int = 0  # token maxima it keeps
    # the module's call it records, (frame, k): its k-th run in a step, in that frame of
    # Dynamo's (None: eager calls); a module run twice in a step has an entry per run (`place`)
    call: tuple[int | None, int] = (None, 0)
    nth: int = 0  # entries of the same (module, io, slot) placed before it


class GraphStats:
    """The device ring of one capture in compiled mode, and the host's view of it."""

    def __init__(self, *, entries: int, tok_rows: int, device: torch.device,
                 channel_limit: int, channel_io: str, slots: int = RING_SLOTS,
                 snap_bytes: int = 0, lazy: bool = False) -> None:
        self.key = next(_KEYS)
        self.device = device
        self.max_entries = int(entries)
        # `slots` steps stay readable on the host: in the ring itself on the CPU; on a GPU in
        # pinned copies, one per step, while the device ring keeps RING_SLOTS (all of each
        # slot's segment rows are allocated there: 16 MiB each)
        self.host_slots = max(1, int(slots))
        # a GPU reads host copies of each step's slot; the CPU reads the ring in place
        self.copies = device.type != "cpu" or HOST_COPIES_ON_CPU
        self.slots = (min(self.host_slots, RING_SLOTS) if self.copies else self.host_slots)
        # a step's channel ranges stay in its slot, read only when a batch needs them
        # (hooks/ringranges.py); `slots` must then cover the flight recorder's ring
        self.lazy = bool(lazy)
        self.ranges_lost = 0  # lazy reads that found their slot moved on (said in the status)
        self.step_t = torch.zeros((), dtype=torch.int64, device=device)
        self.first = statsop.new_first(device)
        # on the CPU the word read in place, at every step's end (graphmode._graph_failed)
        self.first_word = self.first.numpy() if device.type == "cpu" else None
        self._redos0 = collections.Counter(statscpu.REDOS)  # status: this capture's share
        # (tensor, entry) the hooks queued for the next op call (graphhooks._flush); empty
        # between calls, at trace time as at run time. One list for every capture (`QUEUE`):
        # the traced hooks reach it as a global, one source, where a list of each capture's
        # own, reached through every hook's closure, made Dynamo guard in Python that all
        # the closures hold the same object (a lambda guard per hooked module, run at every
        # call of the compiled model)
        self.queue = QUEUE
        # graphhooks._group: the op calls' constants of a queued run of entries
        self.groups: dict[tuple[int, ...], tuple[tuple[Any, ...], ...]] = {}
        for t in (self.step_t, self.first):
            torch._dynamo.mark_static_address(t)
        self.snap = CompiledSnap(device, snap_bytes)  # read in graphmode._graph_snapshot
        self.tok_rows = max(1, int(tok_rows))
        # token maxima, token-major (statsop.py): a step's row r of every entry side by side,
        # so a decode step's maxima are one short run, and a GPU copies only the step's rows;
        # there two slots: each step's rows are copied to the host right after the step, on
        # its stream (the rows of max_entries columns are allocated whole on a device)
        self.toks = new_toks(min(2, self.slots) if self.copies else self.slots,
                             self.tok_rows, self.max_entries, device)
        torch._dynamo.mark_static_address(self.toks)
        self._tok_copied: dict[int, int] = {}  # a GPU: host slot -> token rows its copy holds
        self.channel_limit = int(channel_limit)
        self.channel_io = channel_io
        self.entries: list[Entry] = []
        self.segments: list[torch.Tensor] = []
        self._used: list[int] = []  # floats placed in each segment's row
        self._where: dict[tuple[Any, ...], int] = {}
        # runs of each (module, io, slot) placed in this step, or in this trace attempt of
        # Dynamo's (`_trace_id`): the next run's k (`place`)
        self._occ: collections.Counter = collections.Counter()
        self._trace: Any = None
        self._nth: dict[tuple[int, int, int, int], int] = {}  # (module, io, slot, n) -> entry
        self.lost: list[str] = []  # entries that found no room (said in the status)
        self._order: list[tuple[Any, ...]] | None = None
        self._idx: dict[str, Any] | None = None
        self._gathers: dict[bytes, Any] = {}
        # a GPU: pinned copies of each slot (segments, logits figures, input ids), allocated
        # once; the step each holds and the event that says its copy is done
        self._host: dict[int, list[torch.Tensor]] = {}
        self._event: dict[int, Any] = {}
        self._copied: dict[int, int] = {}
        # modules recorded outside the graph (the logits; vLLM's lm_head), in the order of
        # their calls after the compiled ones: module id -> rank
        self.outside: dict[int, int] = {}
        # outside the graph, per slot: the logits' 18 figures (reduce.exact_logits) and the
        # step's input ids (their count in `ids_n`), read with the slot
        self.figs = torch.full((self.slots, LOGITS_FIGURES), float("nan"), dtype=torch.float32,
                               device=device)
        self.ids = torch.zeros((self.slots, MAX_IDS), dtype=torch.int64, device=device)
        self.ids_n = [0] * self.slots
        _REGISTRY[self.key] = self

    # -- trace time --------------------------------------------------------------------------
    def place(self, mid: int, io: int, slot: int, width: int, dt: int, nonfloat: bool
              ) -> tuple[int, int, int, int, int]:
        """The entry of (module, io, slot) in this call of the module: a new one in call order
        the first time, with its place in the ring: (entry, segment, offset, channel cap, token
        rows); entry -1: no room left, the tensor goes unrecorded and the status says so.
        `width`: the most channels the entry keeps (its module's bound, `width_bound`).

        A module run twice in a step (a shared layer) records each run: its k-th run has an
        entry of its own. Called eagerly, runs are counted from `begin`; at trace time, per
        frame that Dynamo traces (the frame's compiled code calls nothing here: a run in one
        frame and one in the frame after a graph break are told apart by their frames, not by
        a count), from the start of each trace attempt, so that an attempt Dynamo restarts
        places nothing twice and a recompile finds the entries of the first compile."""
        trace = _trace_id()
        if trace != self._trace:  # a new trace attempt, or eager calls again after one
            self._trace = trace
            self._occ.clear()
        occ = self._occ[(mid, io, slot)]
        self._occ[(mid, io, slot)] = occ + 1
        call = (None if trace is None else trace[0], occ)
        k = (mid, io, slot, call)
        e = self._where.get(k)
        if e is None and trace is None:
            # an eager call where a trace placed the module's runs (Dynamo fell back to eager:
            # its recompile limit, a region it skips): the k-th run takes the k-th entry
            e = self._nth.get((mid, io, slot, occ))
            if e is not None:
                self._where[k] = e
        if e is not None:
            return self._geometry(e)
        if len(self.entries) >= self.max_entries:
            self.lost.append(f"module {mid} io {io} slot {slot} run {call}: no entry left")
            self._where[k] = -1
            return (-1, 0, 0, 0, 0)
        keep = width > 1 and (self.channel_io == "all" or (
            self.channel_io == "inputs" and io == schema.IO_INPUT))
        cap = width if keep else 0
        tok = self.tok_rows if width > 1 else 0
        need = entry_width(cap)
        if not self.segments or self._used[-1] + need > self.segments[-1].shape[1]:
            # empty, not zeros: nothing reads a place before the op wrote it (an entry's
            # stamp, set below, says whether its row is this step's), and on the CPU the
            # pages no entry reaches are then never touched: the 16 MiB rows cost memory
            # only as far as they are used (+128 MiB RSS with zeros for HF SmolLM2)
            seg = torch.empty(self.slots, max(SEGMENT_FLOATS, need), dtype=torch.float32,
                              device=self.device)
            torch._dynamo.mark_static_address(seg)
            setattr(self, f"r{len(self.segments)}", seg)  # read by name in the traced hook
            self.segments.append(seg)
            self._used.append(0)
            self._host = {}
        e = len(self.entries)
        nth = 0  # entries of (module, io, slot) placed before: one per run, a handful at most
        while (mid, io, slot, nth) in self._nth:
            nth += 1
        self._nth[(mid, io, slot, nth)] = e
        ent = Entry(mid, io, slot, width, dt, nonfloat, keep, len(self.segments) - 1,
                    self._used[-1], cap, tok, call, nth)
        self.segments[-1][:, ent.off + COL["stamp"]] = -1.0  # the stamp of no step
        self._used[-1] += need
        self.entries.append(ent)
        self._where[k] = e
        self._order = None
        self._idx = None
        return self._geometry(e)

    def _geometry(self, e: int) -> tuple[int, int, int, int, int]:
        if e < 0:
            return (-1, 0, 0, 0, 0)
        ent = self.entries[e]
        return (e, ent.seg, ent.off, ent.cap, ent.tok)

    # -- host side, once per step ------------------------------------------------------------
    def begin(self, step: int) -> None:
        """Before the forward: the step the op writes (its slot and stamp), set by one op on
        the device, ordered before the forward's kernels; no sync. A step's calls are counted
        from here (`place`)."""
        self._occ.clear()
        self._trace = None
        self.step_t.fill_(int(step))

    def put_step_extras(self, step: int, figures: torch.Tensor | None,
                        ids: torch.Tensor | None) -> None:
        """A GPU: the logits' figures and the input ids of `step` into its slot, on the device
        (read with the slot, one step late: no sync)."""
        slot = step % self.slots
        if figures is not None:
            self.figs[slot].copy_(figures.reshape(-1)[:LOGITS_FIGURES], non_blocking=True)
        else:
            self.figs[slot].fill_(float("nan"))
        n = 0
        if ids is not None:
            flat = ids.reshape(-1)
            n = min(int(flat.numel()), MAX_IDS)
            self.ids[slot, :n].copy_(flat[:n], non_blocking=True)
        self.ids_n[slot] = n

    def start_copy(self, step: int, rows: int | None = None) -> None:
        """After the step (on a GPU): its slot of every segment, its first `rows` token rows
        (None: all; the host knows a step's tokens, the entries' rows are those), its logits
        figures and input ids, copied asynchronously into pinned host buffers allocated once
        per slot (the token rows' grown when a step has more); read in `collect`. On CPU:
        nothing (collect reads the ring in place)."""
        if not self.copies:
            return
        slot, hs = step % self.slots, step % self.host_slots
        pin = self.device.type == "cuda"
        t_rows = self.tok_rows if rows is None else max(1, min(int(rows), self.tok_rows))
        ncol = self.toks.shape[2]
        host = self._host.get(hs)
        if host is None or len(host) != len(self.segments) + 3 or any(
                h.numel() < used for h, used in zip(host, self._used)):
            host = self._host[hs] = [  # as much as the entries use: slots x segments
                torch.empty(max(1, used), dtype=torch.float32, pin_memory=pin)
                for used in self._used] + [
                torch.empty(LOGITS_FIGURES, dtype=torch.float32, pin_memory=pin),
                torch.empty(MAX_IDS, dtype=torch.int64, pin_memory=pin),
                torch.empty(0, dtype=torch.float32)]
        if host[-1].numel() < t_rows * ncol:  # grown to the most rows a step had (rare)
            host[-1] = torch.empty(max(t_rows, min(64, self.tok_rows)) * ncol,
                                   dtype=torch.float32, pin_memory=pin)
        for dst, seg, used in zip(host, self.segments, self._used):
            dst[:used].copy_(seg[slot, :used], non_blocking=True)
        tslot = self.toks[step % self.toks.shape[0], :t_rows]
        host[-1][:t_rows * ncol].copy_(tslot.reshape(-1), non_blocking=True)
        self._tok_copied[hs] = t_rows
        host[-3].copy_(self.figs[slot], non_blocking=True)
        n = self.ids_n[slot]
        if n:
            host[-2][:n].copy_(self.ids[slot, :n], non_blocking=True)
        ev = self._event.get(hs)
        if ev is None:
            ev = self._event[hs] = torch.cuda.Event() if pin else _Done()
        ev.record()
        self._copied[hs] = step

    def _host_slot(self, step: int) -> list[np.ndarray]:
        """The host copy of `step`'s slot (a GPU), its copy started if it was not."""
        hs = step % self.host_slots
        if self._copied.get(hs) != step:
            self.start_copy(step)
        self._event[hs].synchronize()  # one step late: long done
        return [h.numpy() for h in self._host[hs]]

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

    def step_extras(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The logits figures and input ids put for `step` (`put_step_extras`)."""
        slot = step % self.slots
        n = self.ids_n[slot]
        if not self.copies:
            return self.figs[slot].numpy().astype(np.float64), self.ids[slot, :n].numpy().copy()
        host = self._host_slot(step)
        return host[-3].astype(np.float64), host[-2][:n].copy()

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
        """The kept entries' channel minima and maxima in `rows` (a slot), side by side."""
        return self._spans(rows, spans, "min"), self._spans(rows, spans, "max")

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

    def call_order(self) -> list[tuple[Any, ...]]:
        """A step's compiled calls, (module, its run: `Entry.call`), in the order their hooks
        first ran; those recorded outside the graph (`outside`) left out."""
        if self._order is None:
            seen: dict[tuple[Any, ...], None] = {}
            for e in self.entries:
                if e.mid not in self.outside:
                    seen.setdefault((e.mid, e.call), None)
            self._order = list(seen)
        return self._order

    def first_nonfinite(self) -> dict[str, int] | None:
        """The op's first-failure word: step, module, io and slot of the first recorded call
        that saw a NaN/Inf (None: none did). One read, at close."""
        got = statsop.decode_first(int(self.first[0]))
        if got is None or not 0 <= got[1] < len(self.entries):
            return None
        step, e, nan = got
        ent = self.entries[e]
        return {"step": step, "module_id": ent.mid, "io": ent.io, "slot": ent.slot,
                "nan": nan}

    def status(self) -> dict[str, Any]:
        st: dict[str, Any] = {
            "graph_entries": len(self.entries), "graph_calls": len(self.call_order()),
            "graph_channels": int(sum(e.cap for e in self.entries if e.cap > 1)),
            "graph_ring": {"slots": self.slots, "host_slots": self.host_slots,
                           "segments": len(self.segments),
                           "bytes": int(sum(s.numel() * 4 for s in self.segments)),
                           "token_bytes": int(self.toks.numel() * 4)},
            **({"graph_not_recorded": self.lost[:20]} if self.lost else {})}
        if self.device.type == "cpu":  # which CPU kernel the op ran: C++, or Python and why
            st["stats_kernel"] = dict(statsnative.KERNEL)
        redos = statscpu.REDOS - self._redos0  # since this capture began (the count is the
        if redos:                              # process's: the CPU kernel knows no capture)
            st["graph_numpy_redos"] = dict(redos)
        if statstriton.skipped_in_capture:  # groups a CUDA graph captured before any call
            st["graph_skipped_in_capture"] = int(statstriton.skipped_in_capture)
        st["snapshot_compiled"] = dict(self.snap.state)
        first = self.first_nonfinite() if self.entries else None
        if first is not None:
            st["graph_first_nonfinite"] = first
        return st

    def close(self) -> None:
        _REGISTRY.pop(self.key, None)
