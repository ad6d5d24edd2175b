"""The one stats op: the statistics of a group of tensors in one call, written into a device
ring.

`torch.ops.qforensics.stats(xs, ring, first, step, off, cap, tok, entry)` reduces each tensor
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
  call order), whichever order the tensors are reduced in.

Why one op for a group: the capture's hooks queue their tensors and the decoder layer's hook
(or a module outside any layer) hands them over at once (hooks/graphhooks.py), so Inductor sees
one opaque call per layer instead of ~10 fused reductions per tensor, its mutations declared
(`ring`, `first`), so the graph writes them in place; the ring is a static buffer that CUDA
graph replays keep writing. `step` is a device counter the host advances before each step (no
sync). The CUDA kernel is Triton (`_stats_kernel`, one program per tensor, one pass over it,
the group's tensors gathered into one buffer: two launches a call); the CPU kernel is numpy on
the tensor's own memory, and reduces a tensor that several entries share (q, k and v's input)
once. Both write the same layout (tests/hooks/test_statsop.py checks them against numpy, the
Triton kernel through Triton's interpreter).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

log = logging.getLogger("qforensics.hooks.capture")

# The record layout of one entry's ring row: defined here and nowhere else.
ENTRY_COLS = ("sum", "sumsq", "min", "max", "nonfinite", "nan", "rows", "channels", "stamp")
N_SCAL = len(ENTRY_COLS)
COL = {name: i for i, name in enumerate(ENTRY_COLS)}
STAMP_MOD = 1 << 24  # float32 holds every integer below this exactly
NO_FIRST = (1 << 63) - 1  # the first-failure word before any failure
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
    """One tensor into its entry's part of `row`: numpy on the tensor's own memory (a float32
    copy for other dtypes), about five passes over it; NaN and inf propagate into the channel
    ranges, so a tensor whose ranges come out finite holds none and skips the masked pass.
    Returns its (non-finite, NaN) counts."""
    x2 = _as_rows(x)
    a = (x2 if x2.dtype == torch.float32 else x2.float()).numpy()
    with np.errstate(over="ignore", invalid="ignore"):  # huge finite values: no warning
        return _fill_cpu(a, row, n, off, cap, tok, x.dim() >= 2)


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
               entry: Sequence[int]) -> None:
    """The CPU kernel: each tensor once, however many entries share it (the same memory,
    shape, strides and caps: its part of the row is copied)."""
    n = int(step)
    row = ring.numpy()[n % ring.shape[0]]
    done: dict[tuple, tuple[int, int, int]] = {}
    best = NO_FIRST
    for x, o, c, k, e in zip(xs, off, cap, tok, entry):
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
            best = min(best, first_key(n, e, nan))
    if best != NO_FIRST:
        f = first.numpy()
        f[0] = min(int(f[0]), best)


# -- the CUDA kernel (Triton) ----------------------------------------------------------------

try:  # Triton is only needed on a GPU
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - absent or broken: no CUDA kernel (capture says so)
    triton = None  # type: ignore[assignment]

TABLE_COLS = 7  # per tensor: start in the gathered buffer, rows, channels, off, cap, tok, entry

if triton is not None:
    @triton.jit
    def _stats_kernel(x_ptr, tab_ptr, ring_ptr, first_ptr, step_ptr, width, nslots,
                      BR: tl.constexpr, BC: tl.constexpr):
        """Program i reduces tensor i of the group ([rows, chans], contiguous, at `start` in
        the gathered buffer) in one pass: row tiles outer, channel tiles inner; channel ranges
        of later row tiles are merged into what the first wrote."""
        t = tab_ptr + tl.program_id(0) * 7
        start = tl.load(t)
        rows = tl.load(t + 1)
        chans = tl.load(t + 2)
        off = tl.load(t + 3)
        cap = tl.load(t + 4)
        tok = tl.load(t + 5)
        entry = tl.load(t + 6)
        keep_chan = (chans > 1) & (chans <= cap)
        step = tl.load(step_ptr)
        base = ring_ptr + (step % nslots) * width + off
        acc_s = tl.zeros((), tl.float32)
        acc_ss = tl.zeros((), tl.float32)
        acc_bad = tl.zeros((), tl.int32)
        acc_nan = tl.zeros((), tl.int32)
        gmin = tl.full((), float("inf"), tl.float32)
        gmax = tl.full((), float("-inf"), tl.float32)
        for r0 in range(0, rows, BR):
            rr = r0 + tl.arange(0, BR)
            rm = rr < rows
            t_fin = tl.zeros((BR,), tl.float32)
            t_nan = tl.zeros((BR,), tl.int32)
            t_inf = tl.zeros((BR,), tl.int32)
            for c0 in range(0, chans, BC):
                cc = c0 + tl.arange(0, BC)
                cm = cc < chans
                m = rm[:, None] & cm[None, :]
                v = tl.load(x_ptr + start + rr[:, None].to(tl.int64) * chans + cc[None, :],
                            mask=m, other=0.0).to(tl.float32)
                isnan = v != v
                isinf = (v == float("inf")) | (v == float("-inf"))
                fin = m & ~isnan & ~isinf
                vz = tl.where(fin, v, 0.0)
                acc_s += tl.sum(tl.sum(vz, axis=1), axis=0)
                acc_ss += tl.sum(tl.sum(vz * vz, axis=1), axis=0)
                acc_bad += tl.sum(tl.sum((m & ~fin).to(tl.int32), axis=1), axis=0)
                acc_nan += tl.sum(tl.sum((m & isnan).to(tl.int32), axis=1), axis=0)
                cmin = tl.min(tl.where(fin, v, float("inf")), axis=0)
                cmax = tl.max(tl.where(fin, v, float("-inf")), axis=0)
                gmin = tl.minimum(gmin, tl.min(cmin, axis=0))
                gmax = tl.maximum(gmax, tl.max(cmax, axis=0))
                if keep_chan:
                    pmin = base + 9 + cc
                    pmax = base + 9 + cap + cc
                    if r0 > 0:
                        cmin = tl.minimum(cmin, tl.load(pmin, mask=cm, other=0.0))
                        cmax = tl.maximum(cmax, tl.load(pmax, mask=cm, other=0.0))
                    tl.store(pmin, cmin, mask=cm)
                    tl.store(pmax, cmax, mask=cm)
                t_fin = tl.maximum(t_fin, tl.max(tl.where(fin, tl.abs(v), 0.0), axis=1))
                t_nan += tl.sum((m & isnan).to(tl.int32), axis=1)
                t_inf += tl.sum((m & isinf).to(tl.int32), axis=1)
            tv = tl.where(t_nan > 0, float("nan"), tl.where(t_inf > 0, float("inf"), t_fin))
            tl.store(base + 9 + 2 * cap + rr, tv, mask=rm & (rr < tok))
            tl.debug_barrier()
        idx = tl.arange(0, 16)
        vals = tl.where(idx == 0, acc_s, tl.where(idx == 1, acc_ss, tl.where(
            idx == 2, gmin, tl.where(idx == 3, gmax, tl.where(
                idx == 4, acc_bad.to(tl.float32), tl.where(idx == 5, acc_nan.to(tl.float32),
                                                            tl.where(idx == 6, rows * 1.0,
                                                                     chans * 1.0)))))))
        vals = tl.where(idx == 8, (step % 16777216).to(tl.float32), vals)
        tl.store(base + idx, vals, mask=idx < 9)
        key = (step << 33) | (entry << 1) | (acc_nan > 0).to(tl.int64)
        tl.atomic_min(first_ptr, key, mask=acc_bad > 0)


_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TABLES: dict[tuple, Tensor] = {}
_TABLES_MAX = 512
skipped_in_capture = 0  # groups not recorded: a CUDA graph captured them before any eager call


def _table(key: tuple, rows: list[list[int]], device: torch.device) -> Tensor | None:
    """The group's per-tensor table on the device, built at its first call (a warm-up runs
    eagerly before a CUDA graph captures) and reused by every later one."""
    t = _TABLES.get(key)
    if t is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None  # no host-to-device copy inside a capture
        if len(_TABLES) >= _TABLES_MAX:
            _TABLES.clear()
        t = _TABLES[key] = torch.tensor(rows, dtype=torch.int64, device=device)
    return t


def launch_triton(xs: Sequence[Tensor], ring: Tensor, first: Tensor, step: Tensor,
                  off: Sequence[int], cap: Sequence[int], tok: Sequence[int],
                  entry: Sequence[int]) -> None:
    """The Triton kernel on a group (a GPU; or CPU tensors under TRITON_INTERPRET=1): the
    tensors gathered into one buffer (one launch; a tensor several entries share, once), then
    one program per entry."""
    global skipped_in_capture
    if not xs:
        return
    x2s = [_as_rows(x) for x in xs]
    dt = x2s[0].dtype
    if dt not in _TRITON_DTYPES or any(x.dtype != dt for x in x2s):
        x2s = [x.float() for x in x2s]
    rows, start, parts = [], 0, []
    at: dict[tuple, int] = {}  # a tensor that several entries share is gathered once
    for x, x2, o, c, k, e in zip(xs, x2s, off, cap, tok, entry):
        r, ch = x2.shape
        same = _same_memory(x)
        s0 = at.get(same)
        if s0 is None:
            s0 = at[same] = start
            parts.append(x2.reshape(-1))
            start += r * ch
        rows.append([s0, r, ch, o, c, k if x.dim() >= 2 else 0, e])
    key = (ring.device, tuple(tuple(r) for r in rows))
    tab = _table(key, rows, ring.device)
    if tab is None:
        skipped_in_capture += 1
        return
    flat = torch.cat(parts) if len(parts) > 1 else parts[0]
    maxc = max(r[2] for r in rows)
    maxr = max(r[1] for r in rows)
    bc = min(max(16, triton.next_power_of_2(max(maxc, 1))), 1024)
    br = max(1, min(triton.next_power_of_2(max(maxr, 1)), max(1, 4096 // bc)))
    _stats_kernel[(len(rows),)](flat, tab, ring, first, step, ring.shape[1], ring.shape[0],
                                BR=br, BC=bc, num_warps=4 if bc * br >= 1024 else 1)


# -- the op ----------------------------------------------------------------------------------

SCHEMA = ("stats(Tensor[] xs, Tensor(a!) ring, Tensor(b!) first, Tensor step, int[] off, "
          "int[] cap, int[] tok, int[] entry) -> ()")


def _define() -> Any:
    """The op through torch.library's low-level registration: one Python kernel per device
    behind the dispatcher (custom_op's autograd and defaults wrappers cost ~60 us a call)."""
    lib = torch.library.Library("qforensics", "FRAGMENT")
    lib.define(SCHEMA)
    lib.impl("stats", _stats_cpu, "CPU")
    if triton is not None:
        lib.impl("stats", launch_triton, "CUDA")

    @torch.library.register_fake("qforensics::stats", lib=lib)
    def _fake(xs, ring, first, step, off, cap, tok, entry):  # noqa: ANN001, ANN202
        return None

    _LIBS.append(lib)  # a Library unregisters its ops when collected


_LIBS: list[Any] = []


def _get() -> Any:
    try:
        return torch.ops.qforensics.stats
    except (AttributeError, RuntimeError):
        _define()
        return torch.ops.qforensics.stats


stats = _get()
