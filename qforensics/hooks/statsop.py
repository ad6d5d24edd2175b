"""The one stats op: a tensor's statistics in one pass, written into a device ring.

`torch.ops.qforensics.stats(x, ring, first, step, off, cap, tok, entry)` reduces `x` (viewed as
[rows, channels], channels the last dim; a 0/1-d tensor is [n, 1]) and writes one entry's row
of the ring slot `step % R` (`ring`: [R, W] float32), laid out as `ENTRY_COLS` says:

    [ sum, sum of squares, min, max, non-finite, nan, rows, channels, stamp | channel minima
      (cap) | channel maxima (cap) | token absmax (tok) ]

- sums, min and max are over the finite values only (min +inf / max -inf when there is none);
  `stamp` is `step mod 2**24`, so the host tells a row written at this step from a stale one;
- the channel ranges are written when `1 < channels <= cap` (finite values only; +inf/-inf for
  a channel without one), the token maxima when `tok > 0` and x has >= 2 dims, for its first
  `min(rows, tok)` rows (NaN for a row that holds a NaN, else inf for one that holds an inf);
- `first` ([3] int64, -1 when unset) takes (step, entry, 1 if NaN else 0) of the first call
  that saw a non-finite value: calls run in order on one stream, so the first writer wins.

Why an op: Inductor sees one opaque call per recorded tensor (instead of ~10 fused reductions
that lengthen its compile), its mutations are declared (`ring`, `first`), so the graph writes
them in place, and the ring is a static buffer that CUDA graph replays keep writing. `step` is
a device counter the host advances after each step (`torch.add_`, no sync). The CUDA kernel is
Triton (`_stats_kernel`, one program, one pass); the CPU kernel is a few torch ops on the
tensor's own memory. Both write the same layout (tests/hooks/test_statsop.py checks them
against numpy, the Triton kernel through Triton's interpreter).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from torch import Tensor

log = logging.getLogger("qforensics.hooks.capture")

# The record layout of one entry's ring row: defined here and nowhere else.
ENTRY_COLS = ("sum", "sumsq", "min", "max", "nonfinite", "nan", "rows", "channels", "stamp")
N_SCAL = len(ENTRY_COLS)
COL = {name: i for i, name in enumerate(ENTRY_COLS)}
STAMP_MOD = 1 << 24  # float32 holds every integer below this exactly
NO_FIRST = -1


def entry_width(cap: int, tok: int) -> int:
    """Floats one entry takes in a ring row: scalars, channel minima and maxima, token maxima."""
    return N_SCAL + 2 * cap + tok


def chan_span(off: int, cap: int) -> tuple[int, int]:
    """Where an entry's channel minima and maxima start in its ring row."""
    return off + N_SCAL, off + N_SCAL + cap


def tok_start(off: int, cap: int) -> int:
    return off + N_SCAL + 2 * cap


def new_first(device: torch.device) -> Tensor:
    return torch.full((3,), NO_FIRST, dtype=torch.int64, device=device)


# -- the CPU kernel --------------------------------------------------------------------------

def _as_rows(x: Tensor) -> Tensor:
    x = x.detach()
    return x.reshape(-1, x.shape[-1]) if x.dim() >= 2 else x.reshape(-1, 1)


def _stats_cpu(x: Tensor, ring: Tensor, first: Tensor, step: Tensor, off: int, cap: int,
               tok: int, entry: int) -> None:
    """The CPU kernel: numpy on the tensor's own memory (a float32 copy for other dtypes),
    about five passes over it; NaN and inf propagate into the channel ranges, so a tensor
    whose ranges come out finite holds none and skips the masked pass."""
    n = int(step)
    row = ring.numpy()[n % ring.shape[0]]
    x2 = _as_rows(x)
    a = (x2 if x2.dtype == torch.float32 else x2.float()).numpy()
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
    if tok > 0 and x.dim() >= 2 and rows:
        k = min(rows, tok)
        t0 = tok_start(off, cap)
        np.abs(a[:k]).max(axis=1, out=row[t0:t0 + k])  # max propagates NaN
    if bad and int(first[0]) == NO_FIRST:
        first.copy_(torch.tensor([n, entry, 1 if nan else 0], dtype=torch.int64))


# -- the CUDA kernel (Triton) ----------------------------------------------------------------

try:  # Triton is only needed on a GPU; without it CUDA tensors take the torch-op kernel
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - absent or broken: no Triton path
    triton = None  # type: ignore[assignment]

if triton is not None:
    @triton.jit
    def _stats_kernel(x_ptr, ring_ptr, first_ptr, step_ptr, rows, chans, width, nslots,
                      off, cap, tok, entry, KEEP_CHAN: tl.constexpr, KEEP_TOK: tl.constexpr,
                      BR: tl.constexpr, BC: tl.constexpr):
        """One program, one pass over x [rows, chans] (contiguous): row tiles outer, channel
        tiles inner. Channel ranges of later row tiles are merged into what the first wrote."""
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
                v = tl.load(x_ptr + rr[:, None].to(tl.int64) * chans + cc[None, :], mask=m,
                            other=0.0).to(tl.float32)
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
                if KEEP_CHAN:
                    pmin = base + 9 + cc
                    pmax = base + 9 + cap + cc
                    if r0 > 0:
                        cmin = tl.minimum(cmin, tl.load(pmin, mask=cm, other=0.0))
                        cmax = tl.maximum(cmax, tl.load(pmax, mask=cm, other=0.0))
                    tl.store(pmin, cmin, mask=cm)
                    tl.store(pmax, cmax, mask=cm)
                if KEEP_TOK:
                    t_fin = tl.maximum(t_fin, tl.max(tl.where(fin, tl.abs(v), 0.0), axis=1))
                    t_nan += tl.sum((m & isnan).to(tl.int32), axis=1)
                    t_inf += tl.sum((m & isinf).to(tl.int32), axis=1)
            if KEEP_TOK:
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
        f0 = tl.load(first_ptr)
        fv = tl.where(idx == 0, step, tl.where(idx == 1, entry, (acc_nan > 0).to(tl.int64)))
        lim = tl.where((acc_bad > 0) & (f0 == -1), 3, 0)  # store 3 words, or none
        tl.store(first_ptr + idx, fv.to(tl.int64), mask=idx < lim)


_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def launch_triton(x: Tensor, ring: Tensor, first: Tensor, step: Tensor, off: int, cap: int,
                  tok: int, entry: int) -> None:
    """The Triton kernel on x (a GPU; or CPU tensors under TRITON_INTERPRET=1)."""
    x2 = _as_rows(x)
    if x2.dtype not in _TRITON_DTYPES:
        x2 = x2.float()
    x2 = x2.contiguous()
    rows, chans = x2.shape
    keep_chan = 1 < chans <= cap
    keep_tok = tok > 0 and x.dim() >= 2
    bc = min(max(16, triton.next_power_of_2(max(chans, 1))), 1024)
    br = max(1, min(triton.next_power_of_2(max(rows, 1)), max(1, 4096 // bc)))
    _stats_kernel[(1,)](x2, ring, first, step, rows, chans, ring.shape[1], ring.shape[0], off, cap, tok,
               entry, KEEP_CHAN=keep_chan, KEEP_TOK=keep_tok, BR=br, BC=bc,
               num_warps=4 if bc * br >= 1024 else 1)


# -- the op ----------------------------------------------------------------------------------

SCHEMA = ("stats(Tensor x, Tensor(a!) ring, Tensor(b!) first, Tensor step, int off, int cap, "
          "int tok, int entry) -> ()")


def _define() -> Any:
    """The op through torch.library's low-level registration: one Python kernel per device
    behind the dispatcher (custom_op's autograd and defaults wrappers cost ~60 us a call)."""
    lib = torch.library.Library("qforensics", "FRAGMENT")
    lib.define(SCHEMA)
    lib.impl("stats", _stats_cpu, "CPU")
    if triton is not None:
        lib.impl("stats", launch_triton, "CUDA")

    @torch.library.register_fake("qforensics::stats", lib=lib)
    def _fake(x, ring, first, step, off, cap, tok, entry):  # noqa: ANN001, ANN202
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
