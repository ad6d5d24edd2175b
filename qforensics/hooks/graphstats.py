"""Capture inside compiled graphs: hooks made of torch ops only, which torch.compile traces and
fuses with the model's own code, writing each call's statistics in place into static buffers.

Why this shape (see docs/architecture.md, "Compiled mode"):
- vLLM compiles the model once, full-graph, and drops every guard. A hook that Dynamo cannot
  trace (a C extension, `.item()`, I/O) is a graph break, which vLLM refuses: the engine dies.
  So a hook here is nothing but tensor ops: finite mask, sums, minima and maxima, per channel
  (last dim) and per token row, copied into slices of buffers allocated before the first
  forward and never reallocated. The same ops run unchanged under CUDA graph replays.
- What a hook learns in Python at trace time is frozen into the graph. That is used once, on
  purpose: `_place` (run by Dynamo at trace time, `assume_constant_result`) gives each recorded
  tensor its entry: a row of the scalar buffer, a region of the channel buffer, a row of the
  token buffer. Entries are placed in the order the hooks run, which is the call order.
- Each entry's row also carries the step stamp the host wrote before the forward, so the host
  tells an entry written in this step from a stale one (a module that did not run).
- The host reads the buffers once per step (`GraphStats.collect`): on CPU a copy, on a GPU an
  asynchronous device-to-host copy into pinned memory started when the forward returns.

No host sync, no Python at replay; per-call figures match the eager capture's (the eager path
reduces finite values only for a tensor holding NaN/Inf, the same as here).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import torch

from qforensics.hooks.callhooks import HIDDEN_KWARGS as _HIDDEN_KWARGS
from qforensics.hooks.reduce import dtype_code
from qforensics.trace import schema

log = logging.getLogger("qforensics.hooks.capture")

SCAL_COLS = 9  # sum, sum of squares, min, max, non-finite, nan, rows, channels, step stamp
STAMP_MOD = 1 << 24  # float32 holds every integer below this exactly
_REGISTRY: dict[int, "GraphStats"] = {}
_KEYS = itertools.count(1)


@dataclass
class Entry:
    mid: int
    io: int
    slot: int
    width: int  # channels kept at most (the module's bound; 1: scalars only)
    dtype: int  # schema.DTYPE_CODES
    nonfloat: bool
    chan: bool  # per-channel min/max kept


class GraphStats:
    """The static buffers of one capture in compiled mode, one small set per entry.

    Each entry (one recorded tensor of one module's call) has buffers of its own, made at trace
    time when the entry is placed, so that each is a whole graph input the graph writes in
    place: its scalar row, its channel minima and maxima, its token maxima. (Slices of one big
    shared buffer would be functionalized into a copy of the whole buffer per write.)"""

    def __init__(self, *, entries: int, tok_rows: int, device: torch.device,
                 channel_limit: int, channel_io: str) -> None:
        self.key = next(_KEYS)
        self.device = device
        self.max_entries = int(entries)
        self.stamp = torch.zeros((), dtype=torch.float32, device=device)
        self.tok_rows = max(1, int(tok_rows))
        self.channel_limit = int(channel_limit)
        self.channel_io = channel_io
        self.entries: list[Entry] = []
        self._s: list[torch.Tensor] = []
        self._c: list[torch.Tensor] = []
        self._t: list[torch.Tensor] = []
        self._where: dict[tuple[int, int, int], int] = {}
        self.lost: list[str] = []  # entries that found no room (said in the status)
        self._order: list[int] | None = None
        self._lay: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._gathers: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
        self._copied: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._event: Any = None
        _REGISTRY[self.key] = self

    # -- trace time --------------------------------------------------------------------------
    def place(self, mid: int, io: int, slot: int, width: int, dt: int, nonfloat: bool) -> int:
        """The entry of (module, io, slot): a new one in call order the first time, with its
        buffers (-1: no room left, the tensor goes unrecorded and the status says so).
        `width`: the most channels the entry keeps (its module's bound, `width_bound`)."""
        k = (mid, io, slot)
        e = self._where.get(k)
        if e is not None:
            return e
        if len(self.entries) >= self.max_entries:
            self.lost.append(f"module {mid} io {io} slot {slot}: no entry left")
            self._where[k] = -1
            return -1
        keep = width > 1 and (self.channel_io == "all" or (
            self.channel_io == "inputs" and io == schema.IO_INPUT))
        e = len(self.entries)
        dev = self.device
        srow = torch.zeros(SCAL_COLS, dtype=torch.float32, device=dev)
        srow[8] = -1.0  # the stamp of no step: nothing written yet
        cbuf = torch.zeros(2, width if keep else 1, dtype=torch.float32, device=dev)
        tbuf = torch.zeros(self.tok_rows, dtype=torch.float32, device=dev)
        # attributes the traced hook reads by name (never a list that Dynamo already read)
        setattr(self, f"s{e}", srow)
        setattr(self, f"c{e}", cbuf)
        setattr(self, f"t{e}", tbuf)
        self._s.append(srow)
        self._c.append(cbuf)
        self._t.append(tbuf)
        self.entries.append(Entry(mid, io, slot, width, dt, nonfloat, keep))
        self._where[k] = e
        self._order = None
        self._copied = None
        return e

    # -- host side, once per step ------------------------------------------------------------
    def begin(self, step: int) -> None:
        """Before the forward: the stamp the hooks copy into their rows (an op on the device,
        ordered before the forward's kernels; no sync)."""
        self.stamp.fill_(float(step % STAMP_MOD))

    def start_copy(self, rows: int | None = None) -> None:
        """After the forward: the entries' buffers gathered on their device (token maxima cut
        to `rows`, the step's token rows when known), and on a GPU copied asynchronously into
        pinned host memory, read in `collect`."""
        if not self.entries:
            return
        n = self.tok_rows if rows is None else max(1, min(int(rows), self.tok_rows))
        with torch.no_grad():
            got = (torch.stack(self._s), torch.cat([c.reshape(-1) for c in self._c]),
                   torch.stack([t[:n] for t in self._t]))
        if self.device.type == "cuda":
            host = tuple(torch.empty(g.shape, dtype=g.dtype, pin_memory=True) for g in got)
            for dst, src in zip(host, got):
                dst.copy_(src, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            got = host
        self._copied = got  # type: ignore[assignment]

    def collect(self, step: int, first_call: int, keep_channels: bool) -> dict[str, Any] | None:
        """This step's records (in call order, call indices from `first_call`), channel and
        token arrays, in the layout of assemble.assemble_records; None when no entry ran."""
        if not self.entries:
            return None
        if self._copied is None:
            self.start_copy()
        assert self._copied is not None
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        s_all, c_all, t_all = (g.numpy() for g in self._copied)
        self._copied = None
        ran = np.nonzero(s_all[:, 8] == float(step % STAMP_MOD))[0]
        if not len(ran):
            return None
        ent = [self.entries[i] for i in ran.tolist()]
        rec = np.zeros(len(ran), dtype=schema.record_dtype())
        mids = np.array([e.mid for e in ent], np.int64)
        order = self.call_order()
        rank = np.zeros(max(order) + 1, np.int64)
        rank[order] = np.arange(len(order))
        rec["call_index"] = first_call + rank[mids]
        rec["step"] = step
        rec["module_id"] = mids
        rec["io"] = [e.io for e in ent]
        rec["slot"] = [e.slot for e in ent]
        rec["dtype"] = [e.dtype for e in ent]
        rec["flags"] = [schema.FLAG_NONFLOAT if e.nonfloat else 0 for e in ent]
        s = s_all[ran].astype(np.float64)
        rows = s[:, 6].astype(np.int64)
        width = s[:, 7].astype(np.int64)
        nonfin, nan = s[:, 4].astype(np.int64), s[:, 5].astype(np.int64)
        numel = rows * width
        finite = np.maximum(numel - nonfin, 1)
        with np.errstate(invalid="ignore", over="ignore"):
            mean = s[:, 0] / finite
            var = np.maximum(s[:, 1] / finite - mean * mean, 0.0)
        none = numel - nonfin <= 0  # no finite value: no finite min/max/mean
        lo = np.where(none, np.nan, s[:, 2])
        hi = np.where(none, np.nan, s[:, 3])
        rec["numel"] = numel
        rec["rows"] = rows
        rec["channels"] = width
        rec["min"], rec["max"] = lo, hi
        rec["mean"] = np.where(none, np.nan, mean)
        rec["std"] = np.where(none, np.nan, np.sqrt(var))
        rec["absmax"] = np.maximum(np.abs(lo), np.abs(hi))
        rec["nan_count"], rec["inf_count"] = nan, nonfin - nan
        # channel ranges: each entry's [2, cap] block in the gathered vector
        caps, chan_kept, _ = self._layout()
        kept = chan_kept[ran] & (width <= caps[ran]) & (width > 1)
        if keep_channels and kept.any():
            idx_min, idx_max = self._gather(ran[kept], width[kept])
            cmin = c_all[idx_min].astype(np.float64)
            cmax = c_all[idx_max].astype(np.float64)
            off = np.full(len(ran), -1, np.int64)
            off[kept] = np.concatenate([[0], np.cumsum(width[kept])[:-1]])
            rec["chan_offset"] = off
        else:
            rec["chan_offset"] = -1
            cmin = cmax = np.zeros(0)
        # token maxima: each entry's row cut to its rows (rows side by side)
        n = t_all.shape[1]
        cnt = np.where(width > 1, np.minimum(rows, n), 0)
        toks = t_all[ran].reshape(-1).copy()
        rec["tok_offset"] = np.where(cnt > 0, np.arange(len(ran)) * n, -1)
        rec["tok_count"] = cnt
        return {"records": rec, "cmin": cmin, "cmax": cmax, "tok": toks}

    def _layout(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per entry: its channel buffer's width, whether it keeps channels, where its block
        starts in the gathered vector (fixed once the graph is traced)."""
        if self._lay is None or len(self._lay[0]) != len(self.entries):
            caps = np.array([c.shape[1] for c in self._c], np.int64)
            self._lay = (caps, np.array([e.chan for e in self.entries], bool),
                         np.concatenate([[0], np.cumsum(2 * caps)[:-1]]).astype(np.int64))
            self._gathers = {}
        return self._lay

    def _gather(self, sel: np.ndarray, widths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Indices of the kept entries' minima and maxima in the gathered vector; the same
        entries and widths come back every step, so they are computed once."""
        key = sel.tobytes() + widths.tobytes()
        got = self._gathers.get(key)
        if got is None:
            caps, _, starts = self._layout()
            base = np.repeat(starts[sel] - np.concatenate([[0], np.cumsum(widths)[:-1]]),
                             widths) + np.arange(int(widths.sum()))
            got = self._gathers[key] = (base, base + np.repeat(caps[sel], widths))
            if len(self._gathers) > 64:
                self._gathers = {key: got}
        return got

    def call_order(self) -> list[int]:
        """Modules in the order their hooks first ran (each module's call once a step)."""
        if self._order is None:
            seen: dict[int, None] = {}
            for e in self.entries:
                seen.setdefault(e.mid, None)
            self._order = list(seen)
        return self._order

    def status(self) -> dict[str, Any]:
        return {"graph_entries": len(self.entries), "graph_calls": len(self.call_order()),
                "graph_channels": int(sum(c.shape[1] for c in self._c if c.shape[1] > 1)),
                **({"graph_not_recorded": self.lost[:20]} if self.lost else {})}

    def close(self) -> None:
        _REGISTRY.pop(self.key, None)


@torch._dynamo.assume_constant_result
def _place(key: int, mid: int, io: int, slot: int, width: int, dt: int, nonfloat: bool) -> int:
    """Run by Dynamo once, at trace time (its result is a constant of the graph); called
    eagerly it is a dict look-up. -1: no entry."""
    gs = _REGISTRY.get(key)
    return -1 if gs is None else gs.place(mid, io, slot, width, dt, nonfloat)


def _record(gs: GraphStats, key: int, mid: int, io: int, slot: int, bound: int,
            t: torch.Tensor) -> None:
    """One tensor's statistics into its entry's buffers: ops only (traced and fused under
    compile). Every argument of `_place` is a constant of the graph; the tensor's own width may
    be symbolic, so it goes into the scalar row. One reduction over the token rows gives the
    per-channel vectors, the scalars are reduced from those, a second over the channels gives
    the per-token maxima."""
    if not t.is_floating_point() and t.dtype != torch.bool and not _is_int(t.dtype):
        return
    e = _place(key, mid, io, slot, bound if t.dim() >= 2 else 1, dtype_code(t.dtype),
               not t.is_floating_point())
    if e < 0:
        return
    srow = getattr(gs, f"s{e}")
    cbuf = getattr(gs, f"c{e}")
    tbuf = getattr(gs, f"t{e}")
    x = t.detach()
    x = x.reshape(-1, x.shape[-1]) if t.dim() >= 2 else x.reshape(-1, 1)
    x = x.float()
    fin = torch.isfinite(x)
    xz = torch.where(fin, x, 0.0)
    lo = torch.where(fin, x, float("inf")).amin(0)
    hi = torch.where(fin, x, float("-inf")).amax(0)
    col_s = xz.sum(0)
    col_ss = (xz * xz).sum(0)
    col_bad = (~fin).sum(0)
    col_nan = torch.isnan(x).sum(0)
    zero = x.new_zeros(())
    srow.copy_(torch.stack([col_s.sum(), col_ss.sum(), lo.amin(), hi.amax(),
                            col_bad.sum().float(), col_nan.sum().float(), zero + x.shape[0],
                            zero + x.shape[1], gs.stamp]))
    cap = cbuf.shape[1]
    if cap > 1 and lo.shape[0] <= cap:
        # the whole buffer, padded: a write into a slice of it would be a scatter that
        # Inductor's reinplacing pass spends minutes on, hundreds of times over
        cbuf.copy_(torch.nn.functional.pad(torch.stack([lo, hi]), (0, cap - lo.shape[0])))
    if t.dim() >= 2:
        # by index, not by a slice of the symbolic length: a slice would put a guard on the
        # token count (vLLM's compile refuses any, its dims are marked dynamic); rows past the
        # buffer (never, with vLLM's batch limit) land on its last element, never out of range
        rows = torch.arange(x.shape[0], device=x.device).clamp_max(gs.tok_rows - 1)
        tbuf.index_copy_(0, rows, x.abs().amax(1))  # NaN (Inf) for a row holding one


def _is_int(dt: torch.dtype) -> bool:
    return dt in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def _tensors(items: Iterable[Any], limit: int) -> list[torch.Tensor]:
    """The first `limit` tensors among `items`."""
    out: list[torch.Tensor] = []
    for a in items:
        if isinstance(a, torch.Tensor):
            out.append(a)
            if len(out) >= limit:
                break
    return out


_WIDTH_ATTRS = ("in_features", "out_features", "input_size", "output_size",
                "input_size_per_partition", "output_size_per_partition", "embedding_dim",
                "hidden_size", "normalized_shape")


def width_bound(module: torch.nn.Module, channel_limit: int) -> int:
    """The most channels any tensor of this module's calls is expected to have, known before
    it runs: its widest parameter dimension or declared size (packed INT4 weights are narrower
    than the layer), at most `channel_limit`."""
    dims = [int(d) for p in module.parameters(recurse=True) for d in p.shape[-2:]]
    for sub in module.modules():
        for a in _WIDTH_ATTRS:
            v = getattr(sub, a, None)
            if isinstance(v, int):
                dims.append(v)
            elif isinstance(v, (tuple, list)) and v and isinstance(v[-1], int):
                dims.append(int(v[-1]))
    return max(1, min(max(dims, default=channel_limit), channel_limit))


def make_hook(gs: GraphStats, mid: int, is_block: bool, bound: int, max_inputs: int,
              max_outputs: int):
    """The forward hook (with kwargs) of one module: the same tensors as the eager capture's
    `_on_call` takes (its first tensor arguments, else a hidden-state keyword; its first
    outputs; a decoder block one of each)."""
    key = gs.key
    n_in_max = 1 if is_block else max_inputs
    n_out_max = 1 if is_block else max_outputs

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        ins = _tensors(args, n_in_max)
        if not ins:
            ins = _tensors([kwargs.get(k) for k in _HIDDEN_KWARGS], 1)
        for slot, a in enumerate(ins):
            _record(gs, key, mid, schema.IO_INPUT, slot, bound, a)
        outs = (output,) if isinstance(output, torch.Tensor) else (
            output if isinstance(output, (tuple, list)) else ())
        for slot, o in enumerate(_tensors(outs, n_out_max)):
            _record(gs, key, mid, schema.IO_OUTPUT, slot, bound, o)

    return hook


def max_entries(is_block: list[bool], max_inputs: int, max_outputs: int) -> int:
    """Entries a capture may place at most: each module's recorded inputs and outputs."""
    return sum(2 if blk else max_inputs + max_outputs for blk in is_block)


def selftest(device: torch.device) -> str | None:
    """Trace a hooked toy module the way vLLM compiles (full graph, backend eager): None when
    it traces, else why not (then capture records no layer in compiled regions)."""
    try:
        lin = torch.nn.Linear(8, 4).to(device)
        gs = GraphStats(entries=4, tok_rows=16, device=device, channel_limit=64,
                        channel_io="all")
        try:
            h = lin.register_forward_hook(make_hook(gs, 0, False, 8, 2, 2), with_kwargs=True)
            fn = torch.compile(lambda x: lin(x) * 2, fullgraph=True, backend="eager",
                               dynamic=True)
            x = torch.ones(3, 8, device=device)
            gs.begin(5)
            fn(x)
            h.remove()
            got = gs.collect(5, 0, True)
            if got is None or len(got["records"]) != 2 or got["records"]["rows"][0] != 3:
                return "a traced hook wrote nothing"
        finally:
            gs.close()
        return None
    except Exception as exc:  # noqa: BLE001 - any failure means: do not trust the path
        return f"{type(exc).__name__}: {str(exc)[:300]}"
