"""Per-step plans: the hook-time work of a step that repeats an earlier step of the same shape.

Decoding repeats itself: every decode step calls the same modules in the same order, with
tensors of the same shapes, shared between calls in the same way (q/k/v read one input; a block
reads the previous block's output). Once a step of a given key (the shape of its input ids,
whether channels are kept, whether version counters exist) has gone through the generic path of
hooks/pending.py with small tensors only, its sequence of takes becomes a `StepPlan`:

- per take, in order: the call's position in the step, module, io and slot folded into one int,
  and the tensor's shape, dtype and device, each checked in one comparison when the hook runs;
  then either the slice of a preallocated buffer the tensor is copied into (`copy_`: one op, no
  allocation; on CPU, for a contiguous tensor, one `ctypes.memmove` of its bytes to the row's
  address, which skips torch's dispatcher: a take in a vLLM decode step 9.2 -> 8.3 us) or the
  earlier take whose tensor this one must be (identity, plus the version counter where there
  is one);
- per (shape, dtype, device): one buffer [n, *shape], reduced as it stands at the end of the
  step (no stack), in chunks of bounded size;
- the host-side facts that do not change: record columns (call position, module, io, slot),
  which unique tensor each record reads, and each unique tensor's shape facts.

A take that does not match hands what the plan took so far to the generic path, which finishes
the step (hooks/pending.py `PendingStep.leave_plan`). Nothing here syncs with the device.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from qforensics.hooks import fused, planunpack, reduce
from qforensics.hooks.assemble import describe

# slot values fold into the take signature below this bound
SLOTS = 1 << 16


def signature(rel_ci: int, mid: int, io: int, slot: int, n_mod: int) -> int:
    """One int per take: (call position in the step, module, io, slot)."""
    return ((rel_ci * n_mod + mid) * 2 + io) * SLOTS + slot


packed_size = fused.packed_len  # reduce.fast_stacked's vector length


class StepPlan:
    """What a repeated step's hooks do (see the module doc). Built by `build`."""

    __slots__ = ("n", "n_mod", "sig", "shapes", "dtypes", "devices", "share", "views", "meta",
                 "meta_rel", "which", "first_pos", "desc", "seen", "red", "described",
                 "nbytes", "reduced", "singles", "dst", "size", "spec", "unpackers", "one_cpu",
                 "out_len", "split", "rspec", "first_pos_arr")

    def reduce(self, outs: list, buf: np.ndarray | None = None, done: np.ndarray | None = None
               ) -> tuple[list, dict[torch.device, list[torch.Tensor]], Any]:
        """The vectors of the tensors reduced in their hooks (`outs`, by take), then
        reduce.fast_parts over each buffer chunk: (plan rows, per-device vectors, to be
        concatenated in this order), in the layout of PendingStep.reduce_on_device; third,
        (SplitLayout, its vector) when the buffers went through hooks/planunpack.py's split
        layout instead (the rows and vectors are then the hook-reduced tensors' only). `buf`,
        `done`: the split vector the takes reduced into, and which unique tensors they did
        (PendingStep.start, hooks/fast_take.c)."""
        per_dev: dict[torch.device, list[torch.Tensor]] = {}
        plan = []
        lay = planunpack.split_layout(self)
        if lay is not None:
            buf = lay.reduce(self.red, buf, done)
            for k, row in self.singles:
                per_dev.setdefault(row[4], []).append(outs[k])
                plan.append(row)
            return plan, per_dev, (lay, buf)
        if self.one_cpu:  # one fresh vector, written in place: no concatenation after
            buf = torch.empty(self.out_len, dtype=torch.float32)
            off = 0
            for k, row in self.singles:
                buf[off:off + row[-1]].copy_(outs[k])
                off += row[-1]
                plan.append(row)
            for x, row in self.red:
                reduce.fast_parts(x, row[1], row[2], row[3], out=buf[off:off + row[-1]])
                off += row[-1]
                plan.append(row)
            return plan, {torch.device("cpu"): [buf]}, None
        for k, row in self.singles:
            packed = outs[k]
            per_dev.setdefault(packed.device, []).append(packed)
            plan.append(row)
        for x, row in self.red:
            _, rows, chans, keep, dev, _ = row
            parts = per_dev.get(dev)
            if parts is None:
                parts = per_dev[dev] = []
            parts += reduce.fast_parts(x, rows, chans, keep)
            plan.append(row)
        return plan, per_dev, None


def build(recs: list, units: list, singles: list, *, first_call: int, n_mod: int, keep: bool,
          chan_limit: int, budget: int) -> StepPlan | None:
    """A plan from one generic step's takes (PendingStep.recs / units / singles), or None when
    the step does not fit one: an empty or meta tensor, a call outside the step, a slot past
    SLOTS, or buffers over `budget` bytes. A tensor the generic step reduced in its hook (a
    large one: logits of a batch, a prefill) is reduced in its hook on the plan too."""
    n = len(recs)
    if not n or not units:
        return None
    nbytes = 0
    reduced = {j: (rows, chans, kp) for j, rows, chans, kp, _ in singles}
    for j, u in enumerate(units):
        seen = u[4]
        if seen is None or (seen is u[0] and j not in reduced):
            return None  # empty / meta
        if j not in reduced:
            nbytes += seen.numel() * seen.element_size()
    if nbytes > budget:
        return None
    pl = StepPlan()
    pl.n, pl.n_mod, pl.nbytes = n, n_mod, nbytes
    meta = np.array([r[:4] for r in recs], np.int64)
    meta[:, 0] -= first_call
    if meta[:, 0].min() < 0 or meta[:, 3].max() >= SLOTS or meta[:, 3].min() < 0:
        return None
    pl.meta_rel = meta
    pl.meta = [tuple(r) for r in meta.tolist()]
    pl.sig = [signature(c, m, io, s, n_mod) for c, m, io, s in pl.meta]
    which = np.array([r[4] for r in recs], np.int64)
    pl.which = which
    first_pos = [-1] * len(units)
    share = [-1] * n
    for k, j in enumerate(which.tolist()):
        if first_pos[j] < 0:
            first_pos[j] = k
        else:
            share[k] = first_pos[j]
    if min(first_pos) < 0:
        return None
    pl.first_pos, pl.share = first_pos, share
    pl.desc = [u[3] for u in units]
    pl.shapes = [pl.desc[j][0] for j in which.tolist()]
    pl.dtypes = [pl.desc[j][1] for j in which.tolist()]
    pl.devices = [pl.desc[j][2] for j in which.tolist()]
    # one buffer per (shape, dtype, device), rows in order of first occurrence
    groups: dict[Any, list[int]] = {}
    for j, d in enumerate(pl.desc):
        if j not in reduced:
            groups.setdefault(d, []).append(j)
    seen: list[Any] = [None] * len(units)
    red = []
    with torch.no_grad():
        for (shape, dtype, device), idx in groups.items():
            buf = torch.empty((len(idx), *shape), dtype=dtype, device=device)
            for i, j in enumerate(idx):
                seen[j] = buf[i]
            chans = int(shape[-1]) if len(shape) else 1
            numel = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
            rows = numel // max(chans, 1)
            kp = keep and chans <= chan_limit
            per = max(1, reduce.REDUCE_CHUNK_ELEMS // max(numel, 1))  # bounded working set
            for k in range(0, len(idx), per):
                sub = idx[k:k + per]
                red.append((buf[k:k + len(sub)], (np.array(sub, np.int64), rows, chans, kp,
                                                   device, packed_size(len(sub), rows, chans,
                                                                       kp))))
    pl.red = red
    # reduced in the hook, at the take that first sees the tensor: (rows, chans, keep)
    pl.reduced = [reduced.get(j) if share[k] < 0 else None for k, j in enumerate(which.tolist())]
    pl.singles = []
    for j, rows, chans, kp, packed in singles:
        pl.singles.append((first_pos[j], (np.array([j], np.int64), rows, chans, kp,
                                          packed.device, int(packed.numel()))))
    pl.seen = seen  # None for the tensors reduced in their hook: the original, per step
    pl.views = [seen[j] if share[k] < 0 and j not in reduced else None
                for k, j in enumerate(which.tolist())]
    # a CPU copy is one memmove into the buffer row (address, bytes), 0: through copy_
    pl.dst = [0] * n
    pl.size = [0] * n
    for k, v in enumerate(pl.views):
        if (v is not None and v.device.type == "cpu" and v.is_contiguous() and v.numel()
                and not v.dtype.is_complex):
            pl.dst[k] = v.data_ptr()
            pl.size[k] = v.numel() * v.element_size()
    pl.described = describe(pl.desc)
    pl.spec = c_spec(pl)
    pl.unpackers = {}  # hooks/planunpack.py, by the step's channel needs
    rows_all = [row for _, row in pl.singles] + [row for _, row in pl.red]
    pl.one_cpu = bool(rows_all) and all(row[4].type == "cpu" for row in rows_all)
    pl.out_len = sum(int(row[-1]) for row in rows_all)
    pl.split = None  # hooks/planunpack.SplitLayout, once the kernel can take the buffers
    pl.rspec = None  # the spec whose takes reduce in their hooks (reduce_spec), once built
    pl.first_pos_arr = np.array(first_pos, np.int64)
    return pl


# a take's mode in hooks/fast_take.c: Python's path, a copy of the bytes, an earlier take's
# tensor, a reduction into the step's split vector (copied as well when it matters)
MODE_PY, MODE_COPY, MODE_SHARE, MODE_REDUCE = 0, 1, 2, 3
# columns per take of reduce_spec's table
REDUCE_COLUMNS = 10


def c_spec(pl: StepPlan) -> tuple | None:
    """The plan as hooks/fast_take.c's Cursor.begin reads it: (signature, share, destination
    address, bytes, mode) as int64 (mode uint8) bytes, then shapes, dtypes and devices; None
    when a signature does not fit an int64 (the takes then run in Python)."""
    mode = bytes(MODE_SHARE if s >= 0 else MODE_COPY if v is not None and d else MODE_PY
                 for s, v, d in zip(pl.share, pl.views, pl.dst))
    try:
        cols = [np.array(c, np.int64).tobytes() for c in (pl.sig, pl.share, pl.dst, pl.size)]
    except OverflowError:
        return None
    return (*cols, mode, tuple(pl.shapes), tuple(pl.dtypes), tuple(pl.devices))


def reduce_spec(pl: StepPlan, lay: Any) -> tuple | bool:
    """c_spec with the copies of the kernel's dtypes turned into reductions where the hook
    takes the tensor (fast_take.c MODE_REDUCE): a ninth item, per take the kernel's address,
    then element offsets of its figures in the split vector (planunpack.SplitLayout.places),
    rows and channels; False when no take qualifies (the plan then copies, as c_spec says)."""
    if pl.spec is None:
        return False
    mode = bytearray(pl.spec[4])
    table = np.zeros((pl.n, REDUCE_COLUMNS), np.int64)
    for k, j in enumerate(pl.which.tolist()):
        if mode[k] != MODE_COPY or j not in lay.places:
            continue
        fn = fused.REDUCER.take_address(pl.dtypes[k])
        if not fn:
            continue
        s, q, mn, mx, lo, hi, t, rows, chans = lay.places[j]
        table[k] = (fn, rows, chans, s, q, mn, mx, lo, hi, t)
        mode[k] = MODE_REDUCE
    if MODE_REDUCE not in mode:
        return False
    return (*pl.spec[:4], bytes(mode), *pl.spec[5:], table.tobytes())
