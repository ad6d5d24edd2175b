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


def unpacker(pl: Any, plan: list, need: np.ndarray) -> PlanUnpack | None:
    """The plan's PlanUnpack for this `need` (built once), or None when its rows span devices."""
    if len({row[4] for row in plan}) != 1:
        return None
    cache = pl.unpackers
    key = need.tobytes()
    up = cache.get(key)
    if up is None:
        up = cache[key] = PlanUnpack(plan, need)
    return up
