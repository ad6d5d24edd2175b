"""Capture inside compiled graphs: the stats op (hooks/statsop.py), one opaque call to
torch.compile, writes the recorded tensors' statistics into a static device ring. This module
holds the ring: its allocation, each entry's place in it (at trace time), the per-step copies
to the host, the status; hooks/graphread.py reads a step's records out of it.

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
- The host reads the slot once per step (`GraphStats.collect`, hooks/graphread.py): on CPU
  in place (numpy views of the ring, no copy); on a GPU through one asynchronous
  device-to-host copy per segment into pinned buffers allocated once, started when the
  forward returns (`start_copy`).
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
from typing import Any, Iterable

import numpy as np
import torch

from qforensics.hooks import statscpu, statsnative, statsop, statstriton
from qforensics.hooks.graphcopy import HostCopies
from qforensics.hooks.graphread import RingReader
from qforensics.hooks.graphsnap import CompiledSnap
from qforensics.hooks.statsop import COL, entry_width, new_toks
from qforensics.trace import schema

log = logging.getLogger("qforensics.hooks.capture")

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


class GraphStats(RingReader, HostCopies):
    """The device ring of one capture in compiled mode, and the host's view of it (its reading:
    `RingReader`, hooks/graphread.py)."""

    def __init__(self, *, entries: int, tok_rows: int, device: torch.device,
                 channel_limit: int, channel_io: str, slots: int = RING_SLOTS,
                 snap_bytes: int = 0, lazy: bool = False, outlier: float = float("inf"),
                 gemm: Iterable[int] = ()) -> None:
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
        # on the CPU the word read in place, at every step's end (graphlate._graph_failed)
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
        # graphhooks._eager_call: a module's runs in this step, and the op calls of an eager
        # hook's (module, run, inputs, dtypes...), kept from its first such run
        self.runs: dict[int, int] = {}
        self.eager: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self.op_calls: list[Any] = []  # the eager plans' OpCalls (hooks/opcall.py), counted
        for t in (self.step_t, self.first):
            torch._dynamo.mark_static_address(t)
        # GEMM modules: their float input.0 may keep the first outlier's snapshot, the first
        # to reach `outlier` (graphhooks._pairs)
        self.gemm = frozenset(int(m) for m in gemm)
        self.snap = CompiledSnap(device, snap_bytes, outlier)  # graphmode._graph_snapshot
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
        # tensors left unrecorded: no entry left, a dtype the op does not take (the status)
        self.lost: list[str] = []
        self._order: list[tuple[Any, ...]] | None = None
        self._idx: dict[str, Any] | None = None  # the reader's caches (RingReader)
        self._gathers: dict[bytes, Any] = {}
        # a GPU: pinned copies of each slot (segments, logits figures, input ids), allocated
        # once; the step each holds and the event that says its copy is done
        self._host: dict[int, list[torch.Tensor]] = {}
        # (slot, token slot, host slot, rows) -> (host buffers, segments' use, (dst, src)
        # views): a step's copies are then copy_ calls only (each view costs a dispatch)
        self._plans: dict[tuple[int, int, int, int], tuple[Any, list[int], list[Any]]] = {}
        self._views: dict[tuple[int, int, int, torch.dtype], torch.Tensor] = {}
        self._event: dict[int, Any] = {}
        self._copied: dict[int, int] = {}
        # the first-failure word as each slot's copy saw it (`copied_first`): pinned, 1 int64
        self._first_host: dict[int, torch.Tensor] = {}
        self._first_np: dict[int, np.ndarray] = {}  # the same words, as numpy views
        # modules recorded outside the graph (the logits; vLLM's lm_head), in the order of
        # their calls after the compiled ones: module id -> rank
        self.outside: dict[int, int] = {}
        # outside the graph, per step (`put_step_extras`), by host slot (pinned on a GPU: copied
        # there at the step's end, one transfer each): its input ids and their count (`ids_n`),
        # its last logits row and its length (`_lrow_n`)
        self._ids: dict[int, torch.Tensor] = {}
        self.ids_n: dict[int, int] = {}
        self._lrow: dict[int, torch.Tensor] = {}
        self._lrow_n: dict[int, int] = {}
        self.error: str | None = None  # an eager hook's failure (`fail`)
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
            self.runs.clear()
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

    def not_taken(self, mid: int, io: int, slot: int, dtype: str) -> None:
        """A tensor of a dtype the op does not take (complex, ...): unrecorded, and said in
        the status once per (module, io, slot, dtype)."""
        line = f"module {mid} io {io} slot {slot}: dtype {dtype} not taken by the stats op"
        if line not in self.lost:  # placing runs once per hook and trace: a short list
            self.lost.append(line)

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
        self.runs.clear()
        self._trace = None
        self.step_t.fill_(int(step))

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
        if self.op_calls:  # eager op calls finished by their OpCall / left to the op
            st["graph_eager_calls"] = {"c": int(sum(c.fast for c in self.op_calls)),
                                       "op": int(sum(c.slow for c in self.op_calls))}
        st["snapshot_compiled"] = dict(self.snap.states[0])
        st["snapshot_compiled_outlier"] = dict(self.snap.states[1])
        first = self.first_nonfinite() if self.entries else None
        if first is not None:
            st["graph_first_nonfinite"] = first
        return st

    def fail(self, exc: BaseException) -> None:
        """An eager hook's call failed: no hook records from now on (`registered` is None),
        and the session degrades at the step's end (`error`); the model's run goes on."""
        if self.error is None:
            self.error = f"{type(exc).__name__}: {exc}"[:500]
        _REGISTRY.pop(self.key, None)
        QUEUE.clear()

    def close(self) -> None:
        _REGISTRY.pop(self.key, None)
