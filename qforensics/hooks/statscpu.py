"""The stats op's CPU kernel in Python: what runs where its C++ kernel (hooks/statsop_cpu.cpp,
hooks/statsnative.py) is not built (hooks/statsop.py defines the op and the record layout; the
CUDA kernel is hooks/statstriton.py's).

The whole group in one call of hooks/fused_reduce.c's `qf_group` when the library is loaded
(`_group_c`: Python describes a call site's tensors once, then hands over their addresses;
built at install time, hooks/prebuild.py; it reads float32, bf16, int64 and int32 rows,
contiguous or a 2-d slice of columns, as vLLM's layers hand over their int positions and a
fused projection's slices), else tensor by tensor in numpy (`_each_cpu`, `_one_numpy`), which
also redoes, exactly, what C does not finish: a non-finite value, another dtype or layout. A tensor that several entries of a call share (q, k and v's input) is
reduced once and its part of the row copied. Every path writes ENTRY_COLS' layout, and the
token maxima into the entry's column of the token ring's slot (`tcol`, a strided view).
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from qforensics.hooks import fused, statsnative, statsop
from qforensics.hooks.statsop import (COL, N_SCAL, NO_FIRST, SNAP, SNAP_COLS, SNAP_HEADER,
                                      STAMP_MOD, chan_span, entry_width, first_key,
                                      snap_region, snap_split, _as_rows, _same_memory)


def _one_cpu(x: Tensor, row: np.ndarray, n: int, off: int, cap: int, tcol: np.ndarray
             ) -> tuple[int, int]:
    """One tensor into its entry's part of `row`, its token maxima into `tcol` (its column
    of the token ring's slot; length 0: none kept), in numpy (`_one_numpy`). Returns its
    (non-finite, NaN) counts."""
    return _one_numpy(x, row, n, off, cap, tcol)


def _one_numpy(x: Tensor, row: np.ndarray, n: int, off: int, cap: int, tcol: np.ndarray
               ) -> tuple[int, int]:
    """Numpy on the tensor's own memory (a float32 copy for other dtypes), about five passes
    over it, exact for non-finite values: NaN and inf propagate into the channel ranges, so a
    tensor whose ranges come out finite holds none and skips the masked pass."""
    x2 = _as_rows(x)
    a = (x2 if x2.dtype == torch.float32 else x2.float()).numpy()
    with np.errstate(over="ignore", invalid="ignore"):  # huge finite values: no warning
        return _fill_cpu(a, row, n, off, cap, tcol, x.dim() >= 2)


_SCRATCH = threading.local()  # per thread: qf_group's done flags, addresses and row maxima


def _fill_cpu(a: np.ndarray, row: np.ndarray, n: int, off: int, cap: int, tcol: np.ndarray,
              per_token: bool) -> tuple[int, int]:
    rows, chans = a.shape
    bad = nan = 0
    if rows:
        lo, hi = a.min(axis=0), a.max(axis=0)
        if np.isfinite(lo.sum()) and np.isfinite(hi.sum()):
            flat = a.reshape(-1)
            # einsum's own loop, not np.dot: BLAS would wake numpy's OpenBLAS threads, which
            # then spin on the cores the model's threads need (vLLM compiled: 1.9x -> 1.4x)
            s = float(a.sum(dtype=np.float64))
            ss = float(np.einsum("i,i->", flat, flat, dtype=np.float64))
        else:
            fin = np.isfinite(a)
            z = np.where(fin, a, np.float32(0))
            lo = np.where(fin, a, np.float32(np.inf)).min(axis=0)
            hi = np.where(fin, a, np.float32(-np.inf)).max(axis=0)
            s, ss = float(z.sum(dtype=np.float64)), float((z * z).sum(dtype=np.float64))
            bad, nan = int(fin.size - np.count_nonzero(fin)), int(np.isnan(a).sum())
        gmin, gmax = float(lo.min()), float(hi.max())
    else:  # no rows: no finite value anywhere, in any channel
        s = ss = 0.0
        gmin, gmax = np.inf, -np.inf
        lo, hi = np.full(chans, np.inf, np.float32), np.full(chans, -np.inf, np.float32)
    row[off:off + N_SCAL] = (s, ss, gmin, gmax, bad, nan, rows, chans, n % STAMP_MOD)
    if 1 < chans <= cap:
        c0, c1 = chan_span(off, cap)
        row[c0:c0 + chans] = lo
        row[c1:c1 + chans] = hi
    if len(tcol) and per_token and rows:
        k = min(rows, len(tcol))
        np.abs(a[:k]).max(axis=1, out=tcol[:k])  # max propagates NaN
    return bad, nan


def stats_cpu(xs: Sequence[Tensor], ring: Tensor, toks: Tensor, first: Tensor, step: Tensor,
              off: Sequence[int], cap: Sequence[int], tok: Sequence[int],
              entry: Sequence[int], snap: Tensor, pair: Sequence[int]) -> None:
    """The CPU kernel: each tensor once, however many entries share it (the same memory,
    shape, strides and caps: its part of the row is copied); the whole group in one call of
    fused_reduce.c (`_group_c`) when it is loaded, else tensor by tensor."""
    n = int(step)
    fn = fused.REDUCER.group()
    counts = (_group_c(fn, xs, ring, toks, n, off, cap, tok, entry) if fn is not None
              else _each_cpu(xs, _row(ring, n), _row(toks, n), n, off, cap,
                             _clamp_tok(toks, tok, entry), entry))
    sn = snap.numpy()
    _outlier_cpu(sn, n, xs, ring, off, entry, pair)
    if not counts:  # every tensor finite: no first-failure word, no snapshot to consider
        return
    best = NO_FIRST
    keep = -1  # the first failing candidate output: the snapshot's call
    for i, (bad, nan) in counts:
        best = min(best, first_key(n, entry[i], nan))
        if keep < 0 and pair[i] >= 0:
            keep = i
    if best != NO_FIRST:
        f = first.numpy()
        f[0] = min(int(f[0]), best)
    a0, cap0 = snap_region(sn.size, 0)
    if keep >= 0 and sn[a0 + SNAP["taken"]] == 0:
        j = pair[keep]
        _snap_cpu(sn[a0:a0 + SNAP_HEADER + cap0], n, xs[keep], entry[keep],
                  xs[j] if j != keep else None, entry[j] if j != keep else -1)


def _outlier_cpu(sn: np.ndarray, n: int, xs: Sequence[Tensor], ring: Tensor,
                 off: Sequence[int], entry: Sequence[int], pair: Sequence[int]) -> None:
    """The first outlier's snapshot (statsop `snap`'s second region): the first candidate
    input of the group, in group order, whose finite absmax (its ring row's min and max,
    just written) reaches the threshold, with its call's output; once a run."""
    b0, cap = snap_region(sn.size, 1)
    if sn[b0 + SNAP["taken"]] != 0 or min(pair, default=0) > -2:
        return
    thr = float(sn[SNAP["thr"]])
    row = _row(ring, n)
    for i, p in enumerate(pair):
        if p <= -2 and max(-float(row[off[i] + COL["min"]]),
                           float(row[off[i] + COL["max"]])) >= thr:
            k = -2 - p
            _snap_cpu(sn[b0:b0 + SNAP_HEADER + cap], n, xs[k], entry[k], xs[i], entry[i])
            return


def _row(ring: Tensor, n: int) -> np.ndarray:
    """The ring's row (or the token ring's slot) of step n, as numpy (a view)."""
    return ring.numpy()[n % ring.shape[0]]


def _clamp_tok(toks: Tensor, tok: Sequence[int], entry: Sequence[int]) -> list[int]:
    """Token maxima each entry keeps: at most the token ring's rows, none for an entry past
    its columns."""
    rows, cols = int(toks.shape[1]), int(toks.shape[2])
    return [min(int(k), rows) if 0 <= e < cols else 0 for k, e in zip(tok, entry)]


_NO_TOKS = np.zeros(0, np.float32)


def _col(tslot: np.ndarray, k: int, e: int) -> np.ndarray:
    """Entry e's first k token maxima in a token ring's slot (a strided view; k 0: none)."""
    return tslot[:k, e] if k else _NO_TOKS


def _each_cpu(xs: Sequence[Tensor], row: np.ndarray, tslot: np.ndarray, n: int,
              off: Sequence[int], cap: Sequence[int], tok: Sequence[int],
              entry: Sequence[int]) -> list[tuple[int, tuple[int, int]]]:
    """The group tensor by tensor; returns (index, (non-finite, NaN)) of those that hold a
    non-finite value, in group order."""
    done: dict[tuple, tuple[int, int, int, int]] = {}
    bad_ones = []
    for i, (x, o, c, k, e) in enumerate(zip(xs, off, cap, tok, entry)):
        key = (_same_memory(x), c, k)
        got = done.get(key)
        if got is None:
            bad, nan = _one_cpu(x, row, n, o, c, _col(tslot, k, e))
            done[key] = (o, e, bad, nan)
        else:
            src, e_src, bad, nan = got
            w = entry_width(c)
            row[o:o + w] = row[src:src + w]
            if k:
                tslot[:k, e] = tslot[:k, e_src]
        if bad:
            bad_ones.append((i, (bad, nan)))
    return bad_ones


GROUP_DESC = 10  # int64 per tensor in fused_reduce.c's qf_group
GROUP_DTYPE = {torch.float32: 0, torch.bfloat16: 1, torch.int64: 2, torch.int32: 3}


def _pitch(x: Tensor, d: int, chans: int) -> int:
    """Elements from one row of x (as [rows, channels]) to the next, for fused_reduce.c: the
    channels for a contiguous tensor, a 2-d slice's row stride (q, k and v cut from one
    projection's output), -1 for a layout C does not read (numpy takes it)."""
    if x.is_contiguous():
        return chans
    if d == 2 and x.stride(1) == 1 and x.stride(0) >= chans:
        return int(x.stride(0))
    return -1


class _Site:
    """One op call's description for `qf_group`, built once per call site: its tensors'
    dtypes, shapes and strides, their entries, and which of them repeat an earlier one (the
    same memory). A compiled graph hands a call site tensors of the same layout step after
    step, at addresses that change (Inductor allocates its buffers per run): only the
    addresses are read at each call (`_group_c`), instead of describing every tensor again
    (~40 us a call hot, ~100 us between a layer's kernels)."""

    __slots__ = ("desc", "addr", "src_of", "spill", "tok")

    def __init__(self, xs: Sequence[Tensor], off: Sequence[int], cap: Sequence[int],
                 tok: Sequence[int], entry: Sequence[int]) -> None:
        desc: list[tuple[int, ...]] = []
        self.src_of: dict[int, int] = {}  # a repeat -> the tensor it repeats
        seen: dict[tuple, int] = {}
        spill = 0
        for i, (x, o, c, k, e) in enumerate(zip(xs, off, cap, tok, entry)):
            key = (_same_memory(x), c, k)  # what `_each_cpu` dedupes on
            j = seen.get(key)
            d = x.dim()
            chans = int(x.shape[-1]) if d >= 2 else 1
            rows = x.numel() // chans if chans else 0
            if j is not None:  # a repeat: its rows, the column it copies in C's place
                self.src_of[i] = j
                desc.append((e, 0, rows, entry[j], o, c, k if d >= 2 else 0, off[j],
                             entry_width(c), 0))
                continue
            seen[key] = i
            code = GROUP_DTYPE.get(x.dtype)
            pitch = _pitch(x, d, chans) if code is not None else -1
            if pitch < 0:
                desc.append((e, -1, 0, 0, o, c, 0, -1, 0, 0))  # not for C: done stays 0
                continue
            kk = k if d >= 2 else 0
            if kk and rows > spill:  # C writes every row's maximum there
                spill = rows
            desc.append((e, code, rows, chans, o, c, kk, -1, 0, pitch))
        self.desc = np.array(desc, np.int64).reshape(-1, GROUP_DESC)
        self.addr = self.desc.ctypes.data
        self.spill = spill
        self.tok = tok  # clamped to the token ring (`_clamp_tok`)


_SITES: dict[tuple, _Site] = {}
_MAX_SITES = 4096  # a server's many batch shapes: forget them all past this, then relearn


def _group_c(fn: Any, xs: Sequence[Tensor], ring: Tensor, toks: Tensor, n: int,
             off: Sequence[int], cap: Sequence[int], tok: Sequence[int], entry: Sequence[int]
             ) -> list[tuple[int, tuple[int, int]]]:
    """The group in one call of fused_reduce.c's `qf_group`: Python only describes each tensor
    (dtype, rows, channels, where its entry goes, or which earlier tensor of the call it
    repeats), once per call site (`_Site`), and hands over their addresses; a tensor the C
    pass does not finish (another dtype or layout, no rows, a non-finite value) is redone
    exactly by `_one_numpy`, and its repeats copied again. Returns what `_each_cpu` returns."""
    m = len(xs)
    ptrs = [x.data_ptr() for x in xs]
    first_of: dict[int, int] = {}  # which tensors share memory: part of what the site is
    key = (tuple([(x.dtype, x.shape, x.stride()) for x in xs]),
           tuple([first_of.setdefault(p, i) for i, p in enumerate(ptrs)]),
           tuple(off), tuple(cap), tuple(tok), tuple(entry), toks.shape[1:])
    site = _SITES.get(key)
    if site is None:
        if len(_SITES) >= _MAX_SITES:
            _SITES.clear()
        site = _SITES[key] = _Site(xs, off, cap, _clamp_tok(toks, tok, entry), entry)
    tok = site.tok
    done, rows_buf, addr, addrs = _group_scratch(m, site.spill)
    addr[:m] = ptrs
    slot = n % ring.shape[0]
    left = fn(m, site.addr, addrs[2], ring.data_ptr() + 4 * slot * ring.stride(0),
              toks.data_ptr() + 4 * (n % toks.shape[0]) * toks.stride(0), toks.shape[2],
              float(n % STAMP_MOD), addrs[1], len(rows_buf), addrs[0])
    if not left:
        return []
    row, tslot = ring.numpy()[slot], _row(toks, n)
    redo = np.flatnonzero(done[:m] == 0)
    counts: dict[int, tuple[int, int]] = {}
    for i in redo.tolist():
        if i not in site.src_of:  # a repeat of a redone tensor is copied below
            counts[i] = _one_numpy(xs[i], row, n, off[i], cap[i],
                                   _col(tslot, tok[i], entry[i]))
            REDOS[_redo_reason(xs[i], site.desc[i], counts[i][0])] += 1
    for i, j in site.src_of.items():
        if j in counts:
            w, k = entry_width(cap[i]), tok[i] if xs[i].dim() >= 2 else 0
            row[off[i]:off[i] + w] = row[off[j]:off[j] + w]
            if k:
                tslot[:k, entry[i]] = tslot[:k, entry[j]]
            counts[i] = counts[j]
    return sorted((i, bn) for i, bn in counts.items() if bn[0])


# Tensors numpy redid after the group's C call, by why (the trace's status says it: a dtype or
# layout C does not read costs ~20 us a tensor more, every step)
REDOS: collections.Counter = collections.Counter()


def _redo_reason(x: Tensor, desc: np.ndarray, bad: int) -> str:
    """Why C left a tensor to numpy: its dtype (and layout) when C does not read it."""
    if desc[1] < 0:
        dt = str(x.dtype).replace("torch.", "")
        return dt if x.is_contiguous() else f"{dt} strided"
    return "non-finite" if bad else "no rows" if not desc[2] else "other"


def _group_scratch(m: int, spill: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, int, int]]:
    """This thread's buffers for `_group_c`, allocated once (grown when a call needs more):
    the `done` flags, the row maxima, the tensors' addresses; and their addresses."""
    done = getattr(_SCRATCH, "done", None)
    if done is None or len(done) < m or len(_SCRATCH.spill) < spill:
        if done is None or len(done) < m:
            done = _SCRATCH.done = np.zeros(max(m, 64), np.int8)
            _SCRATCH.addr = np.zeros(len(done), np.int64)
        if len(getattr(_SCRATCH, "spill", ())) < max(spill, 1):
            _SCRATCH.spill = np.empty(max(spill, 1), np.float32)
        _SCRATCH.addrs = (done.ctypes.data, _SCRATCH.spill.ctypes.data,
                          _SCRATCH.addr.ctypes.data)
    return done, _SCRATCH.spill, _SCRATCH.addr, _SCRATCH.addrs


def _snap_cpu(s: np.ndarray, n: int, out: Tensor, e_out: int, inp: Tensor | None,
              e_in: int) -> None:
    """The snapshot of one call into `s`: its input's rows, its output's, then the header."""
    o2 = _as_rows(out)
    i2 = _as_rows(inp) if inp is not None else o2.new_zeros(0, 0)
    k_in, k_out = snap_split(i2.numel(), o2.numel(), s.size - SNAP_HEADER)
    body = s[SNAP_HEADER:]
    body[:k_in] = i2.reshape(-1)[:k_in].float().numpy()
    body[k_in:k_in + k_out] = o2.reshape(-1)[:k_out].float().numpy()
    s[1:len(SNAP_COLS)] = (n % STAMP_MOD, e_out, e_in, *i2.shape, *o2.shape, k_in, k_out)
    s[SNAP["taken"]] = 1.0


def _kernel(*args: Any) -> None:
    """What the dispatcher calls: `stats_cpu` looked up at each call, so that a timer
    (bench/step_timers.py) can wrap it."""
    stats_cpu(*args)


# the C++ kernel (hooks/statsnative.py) where it is built; this module's Python one otherwise
if not statsnative.load():
    statsop.register_kernel(_kernel, "CPU")
