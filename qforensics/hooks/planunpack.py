"""UniqueStats.unpack for a step that ran on its plan: the same arrays in a few vectorized numpy
calls instead of about twenty per reduced buffer.

On a plan (hooks/plan.py) the reduced vectors come back in the same layout every step: which
unique tensor's sum, sum of squares, min and max sit where, which spans hold its per-channel
ranges and per-token maxima. `PlanUnpack` reads that layout once from the plan's rows (the
`(unique ids, rows, chans, keep, device, size)` tuples of PendingStep.reduce_on_device) and
then fills a UniqueStats with gathers and one `np.minimum/maximum.reduceat` each for the
tensors whose min and max come from their channel ranges. Bit for bit what
`UniqueStats.unpack` gives (tests/hooks/test_planunpack.py); all rows on one device.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from qforensics.hooks import fused, reduce
from qforensics.hooks.assemble import UniqueStats


class PlanUnpack:
    """The fixed layout of one plan's reduced vectors; `apply` fills a UniqueStats."""

    def __init__(self, plan: list, need: np.ndarray) -> None:
        u, pos_s, pos_q, n_el, rows_u = [], [], [], [], []
        d_dst, d_min, d_max = [], [], []  # min/max read directly
        r_dst, r_min, r_max = [], [], []  # min/max over a span of channel ranges
        tok_src, tok_dst, abs_dst, abs_k = [], [], [], []  # per-token maxima
        tok_off, tok_cnt = [], []
        chan_u, chan_off = [], []
        lo_spans, hi_spans = [], []
        shared = True  # every kept block serves as min and max (single-token tensors)
        base = tok_len = chan_len = 0
        for idx, rows, chans, keep, _dev, size in plan:
            g = len(idx)
            idx = [int(j) for j in idx]
            sel = [bool(need[j]) for j in idx]
            k0 = len(u)
            u += idx
            pos_s += range(base, base + g)
            pos_q += range(base + g, base + 2 * g)
            n_el += [float(rows * chans)] * g
            rows_u += [rows] * g
            off = base + 2 * g
            if rows == 1:
                d_dst += range(k0, k0 + g)
                d_min += range(off, off + g)
                d_max += range(off + g, off + 2 * g)
                off += 2 * g
                if keep:
                    for i, j in enumerate(idx):
                        if sel[i]:
                            chan_u.append(j)
                            chan_off.append(chan_len)
                            span = (off + i * chans, off + (i + 1) * chans)
                            lo_spans.append(span)
                            hi_spans.append(span)
                            chan_len += chans
                # a single token's maximum is its absmax, computed in apply
                abs_dst += range(tok_len, tok_len + g)
                abs_k += range(k0, k0 + g)
                tok_off += range(tok_len, tok_len + g)
                tok_cnt += [1] * g
                tok_len += g
            else:
                if keep:
                    lo0, hi0 = off, off + g * chans
                    for i, j in enumerate(idx):
                        r_dst.append(k0 + i)
                        r_min.append((lo0 + i * chans, lo0 + (i + 1) * chans))
                        r_max.append((hi0 + i * chans, hi0 + (i + 1) * chans))
                        if sel[i]:
                            chan_u.append(j)
                            chan_off.append(chan_len)
                            lo_spans.append(r_min[-1])
                            hi_spans.append(r_max[-1])
                            chan_len += chans
                            shared = False
                    off += 2 * g * chans
                else:
                    d_dst += range(k0, k0 + g)
                    d_min += range(off, off + g)
                    d_max += range(off + g, off + 2 * g)
                    off += 2 * g
                tok_src += range(off, off + g * rows)
                tok_dst += range(tok_len, tok_len + g * rows)
                tok_off += range(tok_len, tok_len + g * rows, rows)
                tok_cnt += [rows] * g
                tok_len += g * rows
            base += size
        i64 = np.int64
        self.size = base
        self.u = np.array(u, i64)
        self.pos_s, self.pos_q = np.array(pos_s, i64), np.array(pos_q, i64)
        self.n_el = np.array(n_el, np.float64)
        self.rows_u = np.array(rows_u, i64)
        self.d_dst, self.d_min, self.d_max = (np.array(a, i64) for a in (d_dst, d_min, d_max))
        self.r_dst = np.array(r_dst, i64)
        # reduceat over (start, end) pairs: even results are the spans' reductions
        self.r_min = np.array(r_min, i64).reshape(-1)
        self.r_max = np.array(r_max, i64).reshape(-1)
        self.tok_src, self.tok_dst = np.array(tok_src, i64), np.array(tok_dst, i64)
        self.abs_dst, self.abs_k = np.array(abs_dst, i64), np.array(abs_k, i64)
        self.tok_off, self.tok_cnt = np.array(tok_off, i64), np.array(tok_cnt, i64)
        self.tok_len = tok_len
        self.chan_u, self.chan_off = np.array(chan_u, i64), np.array(chan_off, i64)
        self.chan_len = chan_len
        self.lo = [slice(a, b) for a, b in _merged(lo_spans)]
        self.hi = None if shared else [slice(a, b) for a, b in _merged(hi_spans)]
        self.template: np.ndarray | None = None  # the plan's records (hooks/assemble.py)

    def apply(self, st: UniqueStats, h: np.ndarray) -> None:
        """Fill `st` from `h`, the device's float32 host vector (the plan's part first)."""
        m = len(self.u)
        vmin = np.empty(m)
        vmax = np.empty(m)
        with np.errstate(invalid="ignore", over="ignore"):
            mean = h[self.pos_s].astype(np.float64) / self.n_el
            var = np.maximum(h[self.pos_q].astype(np.float64) / self.n_el - mean * mean, 0.0)
            vmin[self.d_dst] = h[self.d_min]
            vmax[self.d_dst] = h[self.d_max]
            if len(self.r_dst):
                vmin[self.r_dst] = np.minimum.reduceat(h, _ends(self.r_min, len(h)))[::2]
                vmax[self.r_dst] = np.maximum.reduceat(h, _ends(self.r_max, len(h)))[::2]
            absmax = np.maximum(np.abs(vmin), np.abs(vmax))
            st.sc[self.u] = np.stack([vmin, vmax, mean, np.sqrt(var), absmax], axis=1)
        st.rows[self.u] = self.rows_u
        st.computed[self.u] = True
        st.tok_off[self.u] = self.tok_off
        st.tok_cnt[self.u] = self.tok_cnt
        tok = np.empty(self.tok_len, np.float32)
        tok[self.tok_dst] = h[self.tok_src]
        tok[self.abs_dst] = absmax[self.abs_k]
        st._tok, st._tok_len = [tok], self.tok_len
        if len(self.chan_u):
            st.chan_off[self.chan_u] = self.chan_off
            lo = _cat(h, self.lo)
            st._cmin = [lo]
            st._cmax = [lo if self.hi is None else _cat(h, self.hi)]
            st._chan_len = self.chan_len


def _ends(pairs: np.ndarray, n: int) -> np.ndarray:
    """reduceat indices for (start, end) pairs in a vector of n values: a last end at n is
    dropped (the last index reduces to the end), every other index is below n."""
    return pairs[:-1] if pairs[-1] == n else pairs


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent spans joined (in order), so that one kept buffer is one slice."""
    out: list[list[int]] = []
    for a, b in spans:
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _cat(h: np.ndarray, slices: list[slice]) -> np.ndarray:
    return h[slices[0]] if len(slices) == 1 else np.concatenate([h[s] for s in slices])


def unpacker(pl: Any, plan: list, need: np.ndarray, split: bool = False) -> PlanUnpack | None:
    """The plan's PlanUnpack for these rows (all of them, or with `split` the hook-reduced
    ones only) and this `need` (built once), or None when its rows span devices."""
    if len({row[4] for row in plan}) != 1:
        return None
    cache = pl.unpackers
    key = (need.tobytes(), split)
    up = cache.get(key)
    if up is None:
        up = cache[key] = PlanUnpack(plan, need)
    return up


class SplitLayout:
    """A plan's step in one fresh float32 vector laid out for the host, on CPU with the C
    kernel (fused_reduce.c `qf_split_*`): per reduced buffer its tensors' [sum, sum of
    squares, min, max]; then every kept tensor's channel minima in one region, their maxima in
    another (single-token tensors: their values, one region for both when no tensor has more
    rows); then every tensor's per-row absmax. The record's channel and token arrays are then
    views of the regions, not concatenations, and min/max need no pass over channel ranges.

    `red`: the plan's (buffer chunk, row) pairs (hooks/plan.py), all on CPU; a buffer whose
    dtype the kernel does not take (bf16 and fp32 only) is reduced with torch ops into it."""

    def __init__(self, red: list) -> None:
        rows_of = [(row[0], int(row[1]), int(row[2]), bool(row[3])) for _, row in red]
        multi = any(r > 1 and k for _, r, _, k in rows_of)
        n_sums = sum(4 * len(idx) for idx, _, _, _ in rows_of)
        n_chan = sum(len(idx) * c for idx, _, c, k in rows_of if k)
        n_tok = sum(len(idx) * r for idx, r, _, _ in rows_of)
        self.cmin0 = n_sums
        self.cmax0 = n_sums + n_chan if multi else None
        self.tok0 = n_sums + n_chan * (2 if multi else 1)
        self.total = self.tok0 + n_tok
        self.n_chan, self.n_tok = n_chan, n_tok
        self.calls = []  # (sums, cmin, cmax, tok) element offsets per buffer chunk
        self.template: np.ndarray | None = None  # the plan's records (hooks/assemble.py)
        u, n_el, rows_u, tok_off, tok_cnt, chan_u, chan_off = ([] for _ in range(7))
        pos: list[list[int]] = [[], [], [], []]  # where each tensor's S, Q, min, max are
        s = c = t = 0
        for idx, r, ch, k in rows_of:
            g = len(idx)
            self.calls.append((s, self.cmin0 + c if k else None,
                               (self.cmax0 + c if multi else None) if k else None,
                               self.tok0 + t))
            u += [int(j) for j in idx]
            for i in range(4):  # the chunk's sums: [S(g) Q(g) min(g) max(g)]
                pos[i] += range(s + i * g, s + (i + 1) * g)
            s += 4 * g
            n_el += [float(r * ch)] * g
            rows_u += [r] * g
            tok_off += range(t, t + g * r, r)
            tok_cnt += [r] * g
            t += g * r
            if k:
                chan_u += [int(j) for j in idx]
                chan_off += range(c, c + g * ch, ch)
                c += g * ch
        i64 = np.int64
        self.u, self.n_el = np.array(u, i64), np.array(n_el, np.float64)
        # where each chunk's tensors start in `u` (chunks are never empty)
        self.chunk_starts = np.cumsum([0] + [len(idx) for idx, _, _, _ in rows_of[:-1]],
                                      dtype=i64)
        self.pos, self.pos_q, self.pos_mn, self.pos_mx = (np.array(a, i64) for a in pos)
        self.rows_u = np.array(rows_u, i64)
        self.tok_off, self.tok_cnt = np.array(tok_off, i64), np.array(tok_cnt, i64)
        self.chan_u, self.chan_off = np.array(chan_u, i64), np.array(chan_off, i64)
        self.chan_len = np.array([ch for idx, _, ch, k in rows_of if k
                                  for _ in idx], i64)
        # where each unique tensor's figures go, for a take that reduces it in its hook
        # (hooks/fast_take.c, `reduce` below): element offsets of S, Q, min, max, channel
        # minima (or values), channel maxima, row maxima (-1: not written); rows; channels
        self.places: dict[int, tuple[int, ...]] = {}
        for (idx, r, ch, _), (s0, lo, hi, t0) in zip(rows_of, self.calls):
            g = len(idx)
            for i, j in enumerate(idx.tolist()):
                self.places[int(j)] = (s0 + i, s0 + g + i, s0 + 2 * g + i, s0 + 3 * g + i,
                                       -1 if lo is None else lo + i * ch,
                                       -1 if hi is None else hi + i * ch, t0 + i * r, r, ch)

    def reduce(self, red: list, buf: np.ndarray | None = None,
               done: np.ndarray | None = None) -> np.ndarray:
        """Every buffer chunk reduced into a fresh vector (or `buf`, which the hooks wrote
        into): by the kernel, or (a dtype it does not take: fp16, integers) by
        reduce.fast_parts' eager ops, moved into the layout. `done`: per unique tensor, True
        where its hook already reduced it into `buf` (its buffer row was not written)."""
        if buf is None:
            buf = np.empty(self.total, np.float32)
        base = buf.ctypes.data
        todo = range(len(red))
        if done is not None:  # per chunk: did the hooks reduce all of its tensors?
            du = done[self.u]
            if du.all():  # a decode step: the hooks did it all
                return buf
            todo = np.nonzero(~np.logical_and.reduceat(du, self.chunk_starts))[0].tolist()
        for c in todo:
            (x, row), (s, lo, hi, t) = red[c], self.calls[c]
            rows, chans = int(row[1]), int(row[2])
            if done is not None:
                d = done[row[0]]
                if d.any():  # some rows were copied instead (a strided tensor): those alone
                    for i in np.nonzero(~d)[0].tolist():
                        self._reduce_one(x[i], int(row[0][i]), buf)
                    continue
            xk = _for_kernel(x)
            if xk is None or not fused.REDUCER.split(
                    xk, rows, chans, base + 4 * s, None if lo is None else base + 4 * lo,
                    None if hi is None else base + 4 * hi, base + 4 * t):
                _packed_into(x, rows, chans, buf, s, lo, hi, t)
        return buf

    def _reduce_one(self, x: torch.Tensor, j: int, buf: np.ndarray) -> None:
        """One buffer row into its place, as its hook would have reduced it."""
        *offs, rows, chans = self.places[j]
        base = buf.ctypes.data
        ptrs = tuple(None if o < 0 else base + 4 * o for o in offs)
        if not fused.REDUCER.take(x, rows, chans, ptrs):
            raise RuntimeError("split layout: a buffer row the kernel cannot take")

    def packed_of(self, buf: np.ndarray, j: int, keep: bool) -> torch.Tensor:
        """Unique tensor j's figures in `buf` as reduce.fast_one's vector (the layout of
        fused.packed_len for one tensor), for a step that leaves its plan."""
        s, q, mn, mx, lo, hi, t, rows, chans = self.places[j]
        head = buf[[s, q]]
        if rows > 1:
            mid = [buf[lo:lo + chans], buf[hi:hi + chans]] if keep else [buf[[mn, mx]]]
            parts = [head, *mid, buf[t:t + rows]]
        else:
            parts = [head, buf[[mn, mx]]] + ([buf[lo:lo + chans]] if keep else [])
        return torch.from_numpy(np.concatenate(parts).astype(np.float32, copy=False))

    def apply(self, st: UniqueStats, buf: np.ndarray) -> None:
        """Add the buffers' tensors to `st` (after whatever it holds: offsets follow it)."""
        with np.errstate(invalid="ignore", over="ignore"):
            mean = buf[self.pos].astype(np.float64) / self.n_el
            var = np.maximum(buf[self.pos_q].astype(np.float64) / self.n_el - mean * mean,
                             0.0)
            vmin = buf[self.pos_mn].astype(np.float64)
            vmax = buf[self.pos_mx].astype(np.float64)
            st.sc[self.u] = np.stack([vmin, vmax, mean, np.sqrt(var),
                                      np.maximum(np.abs(vmin), np.abs(vmax))], axis=1)
        st.rows[self.u] = self.rows_u
        st.computed[self.u] = True
        st.tok_off[self.u] = st._tok_len + self.tok_off
        st.tok_cnt[self.u] = self.tok_cnt
        st._tok.append(buf[self.tok0:self.tok0 + self.n_tok])
        st._tok_len += self.n_tok
        if not len(self.chan_u):
            return
        need = st.need[self.chan_u]
        lo = buf[self.cmin0:self.cmin0 + self.n_chan]
        hi = lo if self.cmax0 is None else buf[self.cmax0:self.cmax0 + self.n_chan]
        if not need.all():  # only some tensors' ranges are kept (channel_io="inputs")
            spans = [np.arange(o, o + n) for o, n in zip(self.chan_off[need],
                                                        self.chan_len[need])]
            sel = np.concatenate(spans) if spans else np.zeros(0, np.int64)
            lo_k = lo[sel]
            hi = lo_k if self.cmax0 is None else hi[sel]
            lo = lo_k
            offs = np.concatenate([[0], np.cumsum(self.chan_len[need])[:-1]]).astype(np.int64)
            st.chan_off[self.chan_u[need]] = st._chan_len + offs
        else:
            st.chan_off[self.chan_u] = st._chan_len + self.chan_off
        st._cmin.append(lo)
        st._cmax.append(hi)
        st._chan_len += len(lo)


def _for_kernel(x: torch.Tensor) -> torch.Tensor | None:
    """A buffer chunk as the kernel takes it: as it is (bf16, fp32), or in float32 (fp16 and
    integers: vLLM's decoder layers read their int64 positions first; the eager ops convert
    them the same way), or None (float64, complex: reduce.fast_parts keeps their precision)."""
    if fused.REDUCER.split_ready(x.dtype):
        return x
    if x.dtype is torch.float64 or x.dtype.is_complex or x.device.type != "cpu":
        return None
    return x.to(torch.float32) if fused.REDUCER.split_ready(torch.float32) else None


def _packed_into(x: torch.Tensor, rows: int, chans: int, buf: np.ndarray, s: int,
                 lo: int | None, hi: int | None, t: int) -> None:
    """reduce.fast_parts' packed vector of g stacked tensors (its layout: fused.packed_len),
    moved into the split layout at sums `s`, channel regions `lo`/`hi`, row maxima `t`."""
    g, n = int(x.shape[0]), int(x.shape[0]) * chans
    keep = lo is not None
    p = torch.cat(reduce.fast_parts(x, rows, chans, keep)).numpy()
    buf[s:s + 2 * g] = p[:2 * g]  # sums, sums of squares
    if rows > 1 and keep:  # [S Q cmin(gC) cmax(gC) tok]: min and max from the ranges
        lo_v, hi_v = p[2 * g:2 * g + n], p[2 * g + n:2 * g + 2 * n]
        buf[s + 2 * g:s + 3 * g] = lo_v.reshape(g, chans).min(axis=1)
        buf[s + 3 * g:s + 4 * g] = hi_v.reshape(g, chans).max(axis=1)
        buf[t:t + g * rows] = p[2 * g + 2 * n:]
    else:  # [S Q min max], then the values (one row) or the row maxima
        buf[s + 2 * g:s + 4 * g] = p[2 * g:4 * g]
        lo_v = hi_v = p[4 * g:4 * g + n]
        if rows == 1:  # a single row's maximum is its absmax
            with np.errstate(invalid="ignore"):
                buf[t:t + g] = np.maximum(np.abs(p[2 * g:3 * g]), np.abs(p[3 * g:4 * g]))
        else:
            buf[t:t + g * rows] = p[4 * g:]
    if keep:
        buf[lo:lo + n] = lo_v
        if hi is not None:
            buf[hi:hi + n] = hi_v


def split_layout(pl: Any) -> SplitLayout | None:
    """The plan's SplitLayout when its buffers can take it (one CPU device, the kernel
    loaded), else None; built once."""
    if not pl.one_cpu or not pl.red:
        return None
    lay = pl.split
    if lay is None:
        # once the kernel is loaded (a buffer of a dtype it does not take: torch ops)
        if not any(fused.REDUCER.split_ready(x.dtype) for x, _ in pl.red):
            return None
        lay = pl.split = SplitLayout(pl.red)
    return lay
