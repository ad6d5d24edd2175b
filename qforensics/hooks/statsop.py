"""The one stats op: the statistics of a group of tensors in one call, written into a device
ring.

`torch.ops.qforensics.stats(xs, ring, first, step, off, cap, tok, entry, snap, pair)` reduces
each tensor
of `xs` (viewed as [rows, channels], channels the last dim; a 0/1-d tensor is [n, 1]) and writes
its entry's part of the ring slot `step % R` (`ring`: [R, W] float32), at `off[i]`, laid out as
`ENTRY_COLS` says:

    [ sum, sum of squares, min, max, non-finite, nan, rows, channels, stamp | channel minima
      (cap) | channel maxima (cap) | token absmax (tok) ]

- sums, min and max are over the finite values only (min +inf / max -inf when there is none);
  `stamp` is `step mod 2**24`, so the host tells a row written at this step from a stale one;
- the channel ranges are written when `1 < channels <= cap` (finite values only; +inf/-inf for
  a channel without one), the token maxima when `tok > 0` and x has >= 2 dims, for its first
  `min(rows, tok)` rows (NaN for a row that holds a NaN, else inf for one that holds an inf);
- `first` ([1] int64) keeps the least `first_key(step, entry, nan)` of the calls that saw a
  non-finite value: the earliest step, then the entry placed first (entries are placed in
  call order), whichever order the tensors are reduced in;
- `snap` ([SNAP_HEADER + capacity] float32) keeps the first failing output's call once a run:
  the first tensor i of the first call, in group order, that holds a non-finite value and is a
  candidate (`pair[i] >= 0`: an output; `pair[i]` is the index of its module's `input.0` in the
  group, or i itself when the group has none), while the header's `taken` is 0. Its input's
  rows then its own (float32, flattened, split by `snap_split`), the header (`SNAP_COLS`) and
  `taken` = 1. What `qforensics replay` starts from in compiled mode (hooks/graphsnap.py).

Why one op for a group: the capture's hooks queue their tensors and the decoder layer's hook
(or a module outside any layer) hands them over at once (hooks/graphhooks.py), so Inductor sees
one opaque call per layer instead of ~10 fused reductions per tensor, its mutations declared
(`ring`, `first`), so the graph writes them in place; the ring is a static buffer that CUDA
graph replays keep writing. `step` is a device counter the host advances before each step (no
sync). The CUDA kernel is Triton (hooks/statstriton.py: one program per tensor, one pass over
it, the group's tensors gathered into one buffer: two launches a call); the CPU kernel is one
call of hooks/fused_reduce.c's `qf_group` for the whole group (built at install time,
hooks/prebuild.py; it writes the entry columns in ENTRY_COLS' order), numpy on the tensor's own
memory for a tensor C does not finish (a non-finite value, another dtype), and it reduces a
tensor that several entries share (q, k and v's input) once. All write the same layout (tests/hooks/test_statsop.py checks them against numpy, the
Triton kernel through Triton's interpreter).
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from qforensics.hooks import fused

log = logging.getLogger("qforensics.hooks.capture")

# The record layout of one entry's ring row: defined here and nowhere else.
ENTRY_COLS = ("sum", "sumsq", "min", "max", "nonfinite", "nan", "rows", "channels", "stamp")
N_SCAL = len(ENTRY_COLS)
COL = {name: i for i, name in enumerate(ENTRY_COLS)}
STAMP_MOD = 1 << 24  # float32 holds every integer below this exactly
NO_FIRST = (1 << 63) - 1  # the first-failure word before any failure
# The snapshot buffer's header (float32, every value exact below 2**24), then its floats:
# the kept input's, then the output's
SNAP_COLS = ("taken", "step", "out_entry", "in_entry", "in_rows", "in_chans", "out_rows",
             "out_chans", "in_kept", "out_kept")
SNAP = {name: i for i, name in enumerate(SNAP_COLS)}
SNAP_HEADER = 16
_ENTRY_BITS = 32


def entry_width(cap: int, tok: int) -> int:
    """Floats one entry takes in a ring row: scalars, channel minima and maxima, token maxima."""
    return N_SCAL + 2 * cap + tok


def chan_span(off: int, cap: int) -> tuple[int, int]:
    """Where an entry's channel minima and maxima start in its ring row."""
    return off + N_SCAL, off + N_SCAL + cap


def tok_start(off: int, cap: int) -> int:
    return off + N_SCAL + 2 * cap


def new_first(device: torch.device) -> Tensor:
    return torch.full((1,), NO_FIRST, dtype=torch.int64, device=device)


def snap_split(n_in: int, n_out: int, capacity: int) -> tuple[int, int]:
    """Floats of the input and of the output a snapshot keeps: each at least half the capacity
    when the other needs more (the Triton kernel computes the same)."""
    k_in = min(n_in, max(capacity // 2, capacity - n_out))
    return k_in, min(n_out, capacity - k_in)


def first_key(step: int, entry: int, nan: bool) -> int:
    """The first-failure word of one call: ordered by step, then by entry."""
    return (int(step) << (_ENTRY_BITS + 1)) | (int(entry) << 1) | int(bool(nan))


def decode_first(key: int) -> tuple[int, int, int] | None:
    """(step, entry, 1 if NaN else 0) of a first-failure word; None: no failure."""
    key = int(key)
    if key == NO_FIRST or key < 0:
        return None
    return key >> (_ENTRY_BITS + 1), (key >> 1) & ((1 << _ENTRY_BITS) - 1), key & 1


# -- the CPU kernel --------------------------------------------------------------------------

def _as_rows(x: Tensor) -> Tensor:
    x = x.detach()
    return x.reshape(-1, x.shape[-1]) if x.dim() >= 2 else x.reshape(-1, 1)


def _same_memory(x: Tensor) -> tuple:
    """What makes two tensors of one call the same values: memory, dtype, shape, strides."""
    return (x.data_ptr(), x.dtype, tuple(x.shape), tuple(x.stride()))


def _one_cpu(x: Tensor, row: np.ndarray, n: int, off: int, cap: int, tok: int
             ) -> tuple[int, int]:
    """One tensor into its entry's part of `row`: one pass of fused_reduce.c where it takes
    the tensor and the figures come out finite (`_one_c`), else `_one_numpy`. Returns its
    (non-finite, NaN) counts."""
    if _one_c(_as_rows(x), row, n, off, cap, tok, x.dim() >= 2):
        return 0, 0
    return _one_numpy(x, row, n, off, cap, tok)


def _one_numpy(x: Tensor, row: np.ndarray, n: int, off: int, cap: int, tok: int
               ) -> tuple[int, int]:
    """Numpy on the tensor's own memory (a float32 copy for other dtypes), about five passes
    over it, exact for non-finite values: NaN and inf propagate into the channel ranges, so a
    tensor whose ranges come out finite holds none and skips the masked pass."""
    x2 = _as_rows(x)
    a = (x2 if x2.dtype == torch.float32 else x2.float()).numpy()
    with np.errstate(over="ignore", invalid="ignore"):  # huge finite values: no warning
        return _fill_cpu(a, row, n, off, cap, tok, x.dim() >= 2)


_SCRATCH = threading.local()  # per thread: the C call's 4 figures, and its row maxima


def _scratch(spill_rows: int) -> tuple[np.ndarray, np.ndarray | None]:
    """This thread's buffers for `_one_c`, allocated once (grown for a step with more rows
    than an entry keeps): the sums/min/max, and the row maxima to spill (None: not needed)."""
    sc = getattr(_SCRATCH, "scal", None)
    if sc is None:
        sc = _SCRATCH.scal = np.empty(4, np.float32)
        _SCRATCH.rows = np.empty(0, np.float32)
    if not spill_rows:
        return sc, None
    if len(_SCRATCH.rows) < spill_rows:
        _SCRATCH.rows = np.empty(spill_rows, np.float32)
    return sc, _SCRATCH.rows


def _one_c(x2: Tensor, row: np.ndarray, n: int, off: int, cap: int, tok: int,
           per_token: bool) -> bool:
    """One tensor in one pass of fused_reduce.c's take (bf16 or float32, contiguous), its
    figures written straight into the ring row: ~5 us against ~25 for the numpy passes at
    decode shapes. False when it did not do the whole job: the library not loaded (yet), a
    dtype or layout it does not take, or a non-finite value (NaN and inf propagate through
    it): the numpy pass then rewrites the entry, exactly."""
    rows, chans = x2.shape
    if not rows:
        return False
    at = row.ctypes.data
    scal, spill = _scratch(rows if per_token and 0 < tok < rows else 0)
    sp = scal.ctypes.data
    c0, c1 = chan_span(off, cap)
    keep = 1 < chans <= cap
    k = min(rows, tok) if per_token and tok > 0 else 0
    tp = None if not k else spill.ctypes.data if spill is not None else (
        at + 4 * tok_start(off, cap))
    if not fused.REDUCER.take(x2, rows, chans, (sp, sp + 4, sp + 8, sp + 12,
                                                at + 4 * c0 if keep else None,
                                                at + 4 * c1 if keep else None, tp)):
        return False
    s, ss, lo, hi = scal.tolist()
    if not (math.isfinite(s) and math.isfinite(ss) and math.isfinite(lo)
            and math.isfinite(hi)):
        return False
    if spill is not None:
        t0 = tok_start(off, cap)
        row[t0:t0 + k] = spill[:k]
    row[off:off + N_SCAL] = (s, ss, lo, hi, 0, 0, rows, chans, n % STAMP_MOD)
    return True


def _fill_cpu(a: np.ndarray, row: np.ndarray, n: int, off: int, cap: int, tok: int,
              per_token: bool) -> tuple[int, int]:
    rows, chans = a.shape
    bad = nan = 0
    if rows:
        lo, hi = a.min(axis=0), a.max(axis=0)
        if np.isfinite(lo.sum()) and np.isfinite(hi.sum()):
            flat = a.reshape(-1)
            s, ss = float(a.sum(dtype=np.float64)), float(np.dot(flat, flat))
        else:
            fin = np.isfinite(a)
            z = np.where(fin, a, np.float32(0))
            lo = np.where(fin, a, np.float32(np.inf)).min(axis=0)
            hi = np.where(fin, a, np.float32(-np.inf)).max(axis=0)
            s, ss = float(z.sum(dtype=np.float64)), float((z * z).sum(dtype=np.float64))
            bad, nan = int(fin.size - np.count_nonzero(fin)), int(np.isnan(a).sum())
        gmin, gmax = float(lo.min()), float(hi.max())
    else:
        s = ss = 0.0
        gmin, gmax = np.inf, -np.inf
    row[off:off + N_SCAL] = (s, ss, gmin, gmax, bad, nan, rows, chans, n % STAMP_MOD)
    if 1 < chans <= cap:
        c0, c1 = chan_span(off, cap)
        row[c0:c0 + chans] = lo
        row[c1:c1 + chans] = hi
    if tok > 0 and per_token and rows:
        k = min(rows, tok)
        t0 = tok_start(off, cap)
        np.abs(a[:k]).max(axis=1, out=row[t0:t0 + k])  # max propagates NaN
    return bad, nan


def _stats_cpu(xs: Sequence[Tensor], ring: Tensor, first: Tensor, step: Tensor,
               off: Sequence[int], cap: Sequence[int], tok: Sequence[int],
               entry: Sequence[int], snap: Tensor, pair: Sequence[int]) -> None:
    """The CPU kernel: each tensor once, however many entries share it (the same memory,
    shape, strides and caps: its part of the row is copied); the whole group in one call of
    fused_reduce.c (`_group_c`) when it is loaded, else tensor by tensor."""
    n = int(step)
    row = ring.numpy()[n % ring.shape[0]]
    fn = fused.REDUCER.group()
    counts = (_group_c(fn, xs, row, n, off, cap, tok) if fn is not None
              else _each_cpu(xs, row, n, off, cap, tok))
    best = NO_FIRST
    keep = -1  # the first failing candidate output: the snapshot's call
    for i, (bad, nan) in counts:
        best = min(best, first_key(n, entry[i], nan))
        if keep < 0 and pair[i] >= 0:
            keep = i
    if best != NO_FIRST:
        f = first.numpy()
        f[0] = min(int(f[0]), best)
    if keep >= 0 and snap.numpy()[SNAP["taken"]] == 0:
        j = pair[keep]
        _snap_cpu(snap.numpy(), n, xs[keep], entry[keep], xs[j] if j != keep else None,
                  entry[j] if j != keep else -1)


def _each_cpu(xs: Sequence[Tensor], row: np.ndarray, n: int, off: Sequence[int],
              cap: Sequence[int], tok: Sequence[int]) -> list[tuple[int, tuple[int, int]]]:
    """The group tensor by tensor; returns (index, (non-finite, NaN)) of those that hold a
    non-finite value, in group order."""
    done: dict[tuple, tuple[int, int, int]] = {}
    bad_ones = []
    for i, (x, o, c, k) in enumerate(zip(xs, off, cap, tok)):
        key = (_same_memory(x), c, k)
        got = done.get(key)
        if got is None:
            bad, nan = _one_cpu(x, row, n, o, c, k)
            done[key] = (o, bad, nan)
        else:
            src, bad, nan = got
            w = entry_width(c, k)
            row[o:o + w] = row[src:src + w]
        if bad:
            bad_ones.append((i, (bad, nan)))
    return bad_ones


GROUP_DESC = 9  # int64 per tensor in fused_reduce.c's qf_group
_GROUP_DTYPE = {torch.float32: 0, torch.bfloat16: 1}


def _group_c(fn: Any, xs: Sequence[Tensor], row: np.ndarray, n: int, off: Sequence[int],
             cap: Sequence[int], tok: Sequence[int]) -> list[tuple[int, tuple[int, int]]]:
    """The group in one call of fused_reduce.c's `qf_group`: Python only describes each tensor
    (address, dtype, rows, channels, where its entry goes, or which earlier tensor of the call
    it repeats); a tensor the C pass does not finish (another dtype or layout, no rows, a
    non-finite value) is redone exactly by `_one_numpy`, and its repeats copied again.
    Returns what `_each_cpu` returns."""
    m = len(xs)
    desc: list[tuple[int, ...]] = []
    src_of: dict[int, int] = {}  # a repeat -> the tensor it repeats
    seen: dict[tuple, int] = {}
    spill = 0
    for i in range(m):
        x, o, c, k = xs[i], off[i], cap[i], tok[i]
        key = (_same_memory(x), c, k)  # what `_each_cpu` dedupes on
        j = seen.get(key)
        if j is not None:
            src_of[i] = j
            desc.append((0, 0, 0, 0, o, c, k, off[j], entry_width(c, k)))
            continue
        seen[key] = i
        code = _GROUP_DTYPE.get(x.dtype)
        if code is None or not x.is_contiguous():
            desc.append((0, -1, 0, 0, o, c, k, -1, 0))  # not for C: done stays 0
            continue
        d = x.dim()
        chans = int(x.shape[-1]) if d >= 2 else 1
        rows = x.numel() // chans if chans else 0
        kk = k if d >= 2 else 0
        if 0 < kk < rows > spill:
            spill = rows
        desc.append((x.data_ptr(), code, rows, chans, o, c, kk, -1, 0))
    arr = np.array(desc, np.int64)
    done, rows_buf = _group_scratch(m, spill)
    fn(m, arr.ctypes.data, row.ctypes.data, float(n % STAMP_MOD), rows_buf.ctypes.data,
       len(rows_buf), done.ctypes.data)
    redo = np.flatnonzero(done[:m] == 0)
    if not len(redo):
        return []
    counts: dict[int, tuple[int, int]] = {}
    for i in redo.tolist():
        if i not in src_of:  # a repeat of a redone tensor is copied below
            counts[i] = _one_numpy(xs[i], row, n, off[i], cap[i], tok[i])
    for i, j in src_of.items():
        if j in counts:
            w = entry_width(cap[i], tok[i])
            row[off[i]:off[i] + w] = row[off[j]:off[j] + w]
            counts[i] = counts[j]
    return sorted((i, bn) for i, bn in counts.items() if bn[0])


def _group_scratch(m: int, spill: int) -> tuple[np.ndarray, np.ndarray]:
    """This thread's `done` flags and row maxima for `_group_c`, allocated once (grown when a
    call needs more)."""
    done = getattr(_SCRATCH, "done", None)
    if done is None or len(done) < m:
        done = _SCRATCH.done = np.zeros(max(m, 64), np.int8)
    buf = getattr(_SCRATCH, "spill", None)
    if buf is None or len(buf) < spill:
        buf = _SCRATCH.spill = np.empty(max(spill, 1), np.float32)
    return done, buf


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


# -- the op ----------------------------------------------------------------------------------

SCHEMA = ("stats(Tensor[] xs, Tensor(a!) ring, Tensor(b!) first, Tensor step, int[] off, "
          "int[] cap, int[] tok, int[] entry, Tensor(c!) snap, int[] pair) -> ()")


def new_snap(device: torch.device, capacity: int) -> Tensor:
    """A snapshot buffer of `capacity` floats; none (0): `taken` from the start, never kept."""
    s = torch.zeros(SNAP_HEADER + max(0, int(capacity)), dtype=torch.float32, device=device)
    if capacity <= 0:
        s[SNAP["taken"]] = 1.0
    return s


def _define() -> Any:
    """The op through torch.library's low-level registration: one Python kernel per device
    behind the dispatcher (custom_op's autograd and defaults wrappers cost ~60 us a call)."""
    lib = torch.library.Library("qforensics", "FRAGMENT")
    lib.define(SCHEMA)
    lib.impl("stats", _stats_cpu, "CPU")

    @torch.library.register_fake("qforensics::stats", lib=lib)
    def _fake(xs, ring, first, step, off, cap, tok, entry, snap, pair):  # noqa: ANN001, ANN202
        return None

    _LIBS.append(lib)  # a Library unregisters its ops when collected


_LIBS: list[Any] = []


def register_cuda(kernel: Any) -> None:
    """The op's CUDA kernel (hooks/statstriton.py registers its Triton launcher when it is
    imported, so that this module never imports it: no import circle)."""
    _get()
    if _LIBS:
        _LIBS[0].impl("stats", kernel, "CUDA")


def _get() -> Any:
    try:
        return torch.ops.qforensics.stats
    except (AttributeError, RuntimeError):
        _define()
        return torch.ops.qforensics.stats


stats = _get()
