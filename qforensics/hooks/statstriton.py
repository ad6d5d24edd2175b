"""The stats op's CUDA kernel (hooks/statsop.py says what the op writes): Triton, one program
per tensor of the group, one pass over it, the group's tensors gathered into one buffer first
(two launches a call). Tested on the CPU through Triton's interpreter
(tests/hooks/test_statsop.py).

The snapshot (statsop's `snap`, `pair`) is kept in the same launch, without a host sync or an
allocation, so that a CUDA graph replays it: a program whose tensor is a candidate output and
saw a non-finite value, while the header's `taken` reads 0, checks whether an earlier candidate
of its group holds one too (that one is the first failing output; a second pass over it, on
the failure path only), and if none does claims the snapshot with a compare-and-swap on
`taken` (0 -> 1.0's bits) and copies its input's rows and its own into `snap`, then the
header. Programs run in any order; the claim keeps two from writing, the check keeps the
call-order first.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from qforensics.hooks.statsop import SNAP_HEADER, _as_rows, _same_memory

try:  # Triton is only needed on a GPU
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - absent or broken: no CUDA kernel (capture says so)
    triton = None  # type: ignore[assignment]

# per tensor: start in the gathered buffer, rows, channels, off, cap, tok, entry; what it is to
# the snapshots: 1, a candidate output for the first failing output's (then its input's start,
# rows, channels and entry: rows 0, entry -1 for none); 2, a candidate input for the first
# outlier's (then its output's); 0, neither
TABLE_COLS = 12

if triton is not None:
    @triton.jit
    def _stats_kernel(x_ptr, tab_ptr, ring_ptr, tok_ptr, first_ptr, step_ptr, width, nslots,
                      tok_slots, tok_slot, tok_cols, snap_ptr, snap_cap, obase,
                      BR: tl.constexpr,
                      BC: tl.constexpr, BLK: tl.constexpr):
        """Program i reduces tensor i of the group ([rows, chans], contiguous, at `start` in
        the gathered buffer) in one pass: row tiles outer, channel tiles inner; channel ranges
        of later row tiles are merged into what the first wrote. Token maxima go to its
        entry's column of the token ring's slot (`tok_slots` slots of `tok_slot` floats,
        `tok_cols` a row)."""
        t = tab_ptr + tl.program_id(0) * 12
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
        tbase = tok_ptr + (step % tok_slots) * tok_slot + entry
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
            tl.store(tbase + rr.to(tl.int64) * tok_cols, tv, mask=rm & (rr < tok))
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
        # the snapshot: the group's first failing candidate output keeps its call, once
        flag_ptr = snap_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        role = tl.load(t + 7)
        if (acc_bad > 0) & (role == 1):
            if tl.load(flag_ptr) == 0:
                if _earlier(x_ptr, tab_ptr, 1, 0.0, BLK) == 0:
                    if tl.atomic_cas(flag_ptr, 0, 0x3F800000) == 0:  # 1.0f's bits
                        _snap_copy(x_ptr, snap_ptr, snap_cap, tl.load(t + 8), tl.load(t + 9),
                                   tl.load(t + 10), tl.load(t + 11), start, rows, chans,
                                   entry, step, BLK)
        # the first outlier's snapshot (the second region): the group's first candidate input
        # whose finite absmax reaches the threshold keeps its call, once; the same claim
        if role == 2:
            thr = tl.load(snap_ptr + 15)  # statsop SNAP["thr"]
            oflag_ptr = (snap_ptr + obase).to(tl.pointer_type(tl.int32), bitcast=True)
            if (tl.maximum(-gmin, gmax) >= thr) & (tl.load(oflag_ptr) == 0):
                if _earlier(x_ptr, tab_ptr, 2, thr, BLK) == 0:
                    if tl.atomic_cas(oflag_ptr, 0, 0x3F800000) == 0:
                        _snap_copy(x_ptr, snap_ptr + obase, snap_cap, start, rows, chans,
                                   entry, tl.load(t + 8), tl.load(t + 9), tl.load(t + 10),
                                   tl.load(t + 11), step, BLK)

    @triton.jit
    def _earlier(x_ptr, tab_ptr, role, thr, BLK: tl.constexpr):
        """How many values of the group's tensors before this program's, of the same `role`,
        would claim the same snapshot (1: a non-finite value; 2: a finite one at `thr` in
        absolute value): a second pass over them, on the claim's path only (once a run)."""
        n = tl.zeros((), tl.int32)
        for j in range(0, tl.program_id(0)):
            tj = tab_ptr + j * 12
            if tl.load(tj + 7) == role:
                sj = tl.load(tj)
                nj = tl.load(tj + 1) * tl.load(tj + 2)
                for b0 in range(0, nj, BLK):
                    kk = b0 + tl.arange(0, BLK)
                    w = tl.load(x_ptr + sj + kk, mask=kk < nj, other=0.0).to(tl.float32)
                    odd = (w != w) | (w == float("inf")) | (w == float("-inf"))
                    hit = odd if role == 1 else ~odd & (tl.abs(w) >= thr)
                    n += tl.sum(hit.to(tl.int32), axis=0)
        return n

    @triton.jit
    def _snap_copy(x_ptr, snap_ptr, snap_cap, in_start, in_rows, in_chans, in_entry, start,
                   rows, chans, entry, step, BLK: tl.constexpr):
        """The claimed snapshot: the input's rows, the output's (split as statsop.snap_split),
        then the header but `taken` (set by the claim)."""
        n_in = in_rows * in_chans
        n_out = rows * chans
        k_in = tl.minimum(n_in, tl.maximum(snap_cap // 2, snap_cap - n_out))
        k_out = tl.minimum(n_out, snap_cap - k_in)
        body = snap_ptr + 16
        for b0 in range(0, k_in, BLK):
            kk = b0 + tl.arange(0, BLK)
            m = kk < k_in
            tl.store(body + kk, tl.load(x_ptr + in_start + kk, mask=m, other=0.0)
                     .to(tl.float32), mask=m)
        for b0 in range(0, k_out, BLK):
            kk = b0 + tl.arange(0, BLK)
            m = kk < k_out
            tl.store(body + k_in + kk, tl.load(x_ptr + start + kk, mask=m, other=0.0)
                     .to(tl.float32), mask=m)
        idx = tl.arange(0, 16)
        hv = tl.where(idx == 1, (step % 16777216).to(tl.float32), tl.where(
            idx == 2, entry * 1.0, tl.where(idx == 3, in_entry * 1.0, tl.where(
                idx == 4, in_rows * 1.0, tl.where(idx == 5, in_chans * 1.0, tl.where(
                    idx == 6, rows * 1.0, tl.where(idx == 7, chans * 1.0, tl.where(
                        idx == 8, k_in * 1.0, k_out * 1.0))))))))
        tl.store(snap_ptr + idx, hv, mask=(idx > 0) & (idx < 10))


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


def launch_triton(xs: Sequence[Tensor], ring: Tensor, toks: Tensor, first: Tensor,
                  step: Tensor,
                  off: Sequence[int], cap: Sequence[int], tok: Sequence[int],
                  entry: Sequence[int], snap: Tensor, pair: Sequence[int]) -> None:
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
    start, parts, where = 0, [], []
    at: dict[tuple, int] = {}  # a tensor that several entries share is gathered once
    for x, x2 in zip(xs, x2s):
        same = _same_memory(x)
        s0 = at.get(same)
        if s0 is None:
            s0 = at[same] = start
            parts.append(x2.reshape(-1))
            start += x2.numel()
        where.append((s0, *x2.shape))
    rows = []
    t_rows, t_cols = int(toks.shape[1]), int(toks.shape[2])
    for i, (x, o, c, k, e, p) in enumerate(zip(xs, off, cap, tok, entry, pair)):
        other = p if p >= 0 and p != i else -2 - p if p <= -2 else -1  # its input / output
        src = where[other] if other >= 0 else (0, 0, 0)
        k = min(int(k), t_rows) if x.dim() >= 2 and 0 <= e < t_cols else 0
        rows.append([*where[i], o, c, k, e, 1 if p >= 0 else 2 if p <= -2 else 0, *src,
                     entry[other] if other >= 0 else -1])
    key = (ring.device, tuple(tuple(r) for r in rows))
    tab = _table(key, rows, ring.device)
    if tab is None:
        skipped_in_capture += 1
        return
    flat = torch.cat(parts) if len(parts) > 1 else parts[0]
    maxc = max(r[2] for r in rows)
    maxr = max(r[1] for r in rows)
    half = snap.numel() // 2  # statsop.snap_region: two regions of equal size
    bc = min(max(16, triton.next_power_of_2(max(maxc, 1))), 1024)
    br = max(1, min(triton.next_power_of_2(max(maxr, 1)), max(1, 4096 // bc)))
    _stats_kernel[(len(rows),)](flat, tab, ring, toks, first, step, ring.shape[1],
                                ring.shape[0], toks.shape[0], t_rows * t_cols, t_cols, snap,
                                half - SNAP_HEADER, half, BR=br, BC=bc, BLK=1024,
                                num_warps=4 if bc * br >= 1024 else 1)


if triton is not None:  # the op's CUDA kernel (statsop.register_kernel)
    from qforensics.hooks import statsop as _statsop

    _statsop.register_kernel(launch_triton, "CUDA")
