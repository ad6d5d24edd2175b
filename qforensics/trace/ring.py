"""Where a record's per-channel ranges live in a format 1.1 trace (no torch import).

A record flagged FLAG_RING has a `chan_offset` relative to its step's channel block, and that
block is either
- in `/channels/promoted` (copied into `/channels` after a trigger fired), or
- still in the fixed-size circular region `/ring` (slot `step % K`, valid while `/ring/step`
  of that slot names the step), or
- gone (overwritten by a later step): the record then has no channel ranges (-1).

The reader turns ring-relative offsets into one address space: offsets below the length of
`/channels` are rows of `/channels`; `base + slot * width + i` is element i of ring slot `slot`.
Every index is validated against the arrays it points into; bad values read as "not stored".
"""

from __future__ import annotations

import h5py
import numpy as np

from qforensics.errors import TraceFormatError
from qforensics.trace import schema


class RingIndex:
    def __init__(self, f: h5py.File, path: str, n_flat: int) -> None:
        self.base = int(n_flat)
        self.slots = 0
        self.width = 0
        self._f = f
        self.prom_step = np.zeros(0, np.int64)
        self.prom_off = np.zeros(0, np.int64)
        self.prom_cnt = np.zeros(0, np.int64)
        prom = f.get("channels/promoted")
        if isinstance(prom, h5py.Group):
            cols = {}
            for name, _, _ in schema.PROMOTED_COLUMNS:
                ds = prom.get(name)
                if not isinstance(ds, h5py.Dataset) or ds.ndim != 1 or ds.dtype.kind not in "iu":
                    raise TraceFormatError(f"{path}: /channels/promoted/{name} malformed")
                cols[name] = ds
            n = min(ds.shape[0] for ds in cols.values())
            st, off, cnt = (cols[k][:n].astype(np.int64) for k in ("step", "offset", "count"))
            ok = (off >= 0) & (cnt >= 0) & (off + cnt <= self.base)
            order = np.argsort(st[ok], kind="stable")
            self.prom_step, self.prom_off, self.prom_cnt = (a[ok][order] for a in (st, off, cnt))
        ring = f.get("ring")
        if not isinstance(ring, h5py.Group):
            return
        dmin, dmax = ring.get("min"), ring.get("max")
        rstep, rcount = ring.get("step"), ring.get("count")
        if not all(isinstance(d, h5py.Dataset) for d in (dmin, dmax, rstep, rcount)):
            raise TraceFormatError(f"{path}: /ring is missing one of min, max, step, count")
        assert isinstance(dmin, h5py.Dataset) and isinstance(dmax, h5py.Dataset)
        assert isinstance(rstep, h5py.Dataset) and isinstance(rcount, h5py.Dataset)
        if (dmin.ndim != 2 or dmin.shape != dmax.shape or dmin.dtype.kind != "f"
                or dmax.dtype.kind != "f" or rstep.shape != (dmin.shape[0],)
                or rcount.shape != (dmin.shape[0],) or rstep.dtype.kind not in "iu"
                or rcount.dtype.kind not in "iu"):
            raise TraceFormatError(f"{path}: /ring datasets have inconsistent shapes or dtypes")
        self.slots, self.width = int(dmin.shape[0]), int(dmin.shape[1])
        self.ring_step = rstep[:].astype(np.int64)
        self.ring_count = np.clip(rcount[:].astype(np.int64), 0, self.width)
        self._min, self._max = dmin, dmax

    def resolve(self, chan_offset: np.ndarray, flags: np.ndarray, step: np.ndarray,
                channels: np.ndarray) -> np.ndarray:
        """Offsets in the reader's address space; -1 where the ranges are not (or no longer)
        stored."""
        out = np.asarray(chan_offset, np.int64).copy()
        ring = ((np.asarray(flags).astype(np.int64) & schema.FLAG_RING) != 0) & (out >= 0)
        if not ring.any():
            return out
        rel = out[ring]
        st = np.asarray(step, np.int64)[ring]
        n = np.asarray(channels, np.int64)[ring]
        got = np.full(len(rel), -1, np.int64)
        if len(self.prom_step):
            i = np.clip(np.searchsorted(self.prom_step, st), 0, len(self.prom_step) - 1)
            hit = (self.prom_step[i] == st) & (rel + n <= self.prom_cnt[i]) & (n >= 0)
            got = np.where(hit, self.prom_off[i] + rel, got)
        if self.slots:
            slot = st % self.slots
            live = (self.ring_step[slot] == st) & (rel + n <= self.ring_count[slot]) & (n >= 0)
            got = np.where((got < 0) & live, self.base + slot * self.width + rel, got)
        out[ring] = got
        return out

    def read(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(min, max) for a span of ring addresses, or None when it is not inside one slot."""
        if not self.slots or lo < self.base or hi < lo:
            return None
        slot, a = divmod(lo - self.base, self.width) if self.width else (0, 0)
        b = a + (hi - lo)
        if slot >= self.slots or b > self.ring_count[slot]:
            return None
        return self._min[slot, a:b], self._max[slot, a:b]
