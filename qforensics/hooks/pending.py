"""One step's hook-time state: what each hook saw, taken when the hook saw it.

A hook hands each tensor to `PendingStep.take`. A tensor seen before in this step (q/k/v and
gate/up share one input; a block's input is the previous block's output) and not modified since
is only referenced again. A new small tensor (decoding: one token) is copied on its own device
with one `clone`; a new large one (a prefill) is reduced right there, on its device, to the small
vector of `reduce.fast_one`. Either way the statistics describe the tensor as the hook saw it,
even when the model changes it in place afterwards, and nothing waits for the device: there is
no host sync in a hook. At the end of the step the copies are stacked per (shape, dtype, device)
and reduced in a few batched ops, and everything goes to the host in one transfer per device.

Memory: copies and the references kept for the exact pass and snapshots count against
`budget`; past it the session reduces early (`over_budget`).
"""

from __future__ import annotations

from ctypes import memmove
from typing import Any

import numpy as np
import torch

from qforensics.hooks import fast_take, planunpack, reduce
from qforensics.hooks.plan import SLOTS, StepPlan
from qforensics.hooks.plan import build as build_plan
from qforensics.hooks.plan import reduce_spec as plan_reduce_spec

# a take's state in a step on a plan with reductions (hooks/fast_take.c ST_*): copied (or not
# taken), reduced in its hook, reduced and copied
ST_NONE, ST_REDUCED, ST_COPIED = 0, 1, 2

# A tensor with at most this many elements is copied at hook time and reduced with others of
# its shape at the end of the step; a larger one is reduced in the hook.
CLONE_LIMIT = 1 << 16
MAX_PLANS = 8  # step plans kept (keys: input shape, channels kept, version counters)
MAX_MISSES = 4  # plans of one key that stopped matching before that key gets none


class PendingStep:
    """Records (call, module, io, slot -> unique tensor) and the unique tensors of one step.

    A step that repeats an earlier one of the same key runs on that step's `StepPlan`
    (hooks/plan.py): `take` checks each tensor against the plan and copies it into the plan's
    buffer; on the first mismatch `leave_plan` turns what was taken into the generic state."""

    __slots__ = ("recs", "units", "uniq", "groups", "singles", "nbytes", "keep", "chan_limit",
                 "track", "nograd", "clone_limit", "plans", "plan", "key", "first", "pos",
                 "refs", "vers", "outs", "missed", "n_mod", "plan_budget", "_misses", "take",
                 "_cursor", "split_out", "split_buf", "state", "copy_above", "carried",
                 "dropped")

    def __init__(self, clone_limit: int = CLONE_LIMIT, plan_budget: int = 256 << 20) -> None:
        self.clone_limit = clone_limit
        self.keep = True
        self.chan_limit = 8192
        self.track = True
        self.nograd = False  # autograd off: a copy needs no detach
        self.plans: dict[Any, StepPlan] = {}  # key -> plan (at most MAX_PLANS)
        self._misses: dict[Any, int] = {}  # key -> plans that missed (past MAX_MISSES: none)
        self.plan_budget = plan_budget
        self.n_mod = 1
        self.key: Any = None
        self.first = 0
        self.plan: StepPlan | None = None
        self.missed = False
        # a take reduced in its hook is also copied from this absmax on (the session sets it:
        # the outlier snapshot needs the tensor); non-finite ones always are
        self.copy_above = float("inf")
        # `take` is the hooks' entry: hooks/fast_take.c's Cursor.take once that is built (a
        # plan's takes in C, the rest handed to _take_slow), else _take_py
        self._cursor: Any = None
        self.take = self._take_py
        self.clear()

    def start(self, key: Any, first_call: int) -> None:
        """A step begins: run it on the plan of its key when there is one."""
        self.clear()
        self.key = key
        self.first = first_call
        self.missed = False
        pl = self.plans.get(key)
        self.plan = pl
        if pl is not None:
            self.refs = [None] * pl.n
            self.vers = [0] * pl.n if self.track else None
            if pl.singles:
                self.outs = [None] * pl.n
            cur = self._cursor
            if cur is None and pl.spec is not None:
                cur = self.ensure_cursor()
            if cur is not None and pl.spec is not None:
                # on CPU with the kernel loaded, the takes reduce in their hooks, straight into
                # the step's split vector (no copy, no second pass over cold memory)
                lay = planunpack.split_layout(pl)
                if lay is not None and pl.rspec is None:
                    pl.rspec = plan_reduce_spec(pl, lay)
                if lay is not None and pl.rspec:
                    buf = self.split_buf = np.empty(lay.total, np.float32)
                    state = self.state = np.zeros(pl.n, np.uint8)
                    cur.begin(pl.rspec, self.refs, self.vers, first_call, pl.n_mod,
                              buf.ctypes.data, lay.total, state.ctypes.data, self.copy_above)
                else:
                    cur.begin(pl.spec, self.refs, self.vers, first_call, pl.n_mod)

    def ensure_cursor(self) -> Any:
        """The C cursor (hooks/fast_take.c), made once the extension is built; else None (a
        build starts in the background)."""
        if self._cursor is None:
            cursor_type = fast_take.TAKER.cursor_type()
            if cursor_type is not None:
                self._cursor = cursor_type(self._take_slow)
                self.take = self._cursor.take
        return self._cursor

    def take_status(self) -> dict[str, Any]:
        """For the trace's status: whether plan takes ran in C, and how many did."""
        st = fast_take.TAKER.status()
        if self._cursor is not None:
            (st["c_takes"], st["python_takes"], st["c_hook_calls"], st["hook_reductions"],
             st["hook_copies"]) = self._cursor.counts
        return st

    def _sync(self) -> None:
        """Take the C cursor's position back (before Python reads or moves `pos`)."""
        cur = self._cursor
        if cur is not None and cur.active:
            self.pos = cur.pos

    def _take_slow(self, ci: int, mid: int, io: int, slot: int, t: torch.Tensor) -> None:
        """The C cursor's fallback: a take it did not do, done by _take_py."""
        cur = self._cursor
        if cur.active:
            self.pos = cur.pos
            self._take_py(ci, mid, io, slot, t)
            if self.plan is not None:
                cur.pos = self.pos
        else:
            self._take_py(ci, mid, io, slot, t)

    def clear(self) -> None:
        # record: (call_index, module_id, io, slot, unique index, version when its hook ran)
        self.recs: list[tuple[int, int, int, int, int, int]] = []
        # unique: [original (keeps its id stable), version when first seen (inference mode:
        # 0 first seen as an input, -1 as an output), last call that took it, (shape, dtype,
        # device), the tensor as the hook saw it (a copy, the original, or None)]
        self.units: list[list[Any]] = []
        self.uniq: dict[int, int] = {}  # id(original) -> unique index
        self.groups: dict[Any, list[int]] = {}  # (shape, dtype, device) -> uniques copied
        self.singles: list[tuple[int, int, int, bool, torch.Tensor]] = []  # reduced in the hook
        # taken on a plan that the step then left, reduced in their hooks (hooks/fast_take.c):
        # their figures as singles' are, and those of them never copied (their buffer rows
        # stale: `seen` is None for them)
        self.carried: list[tuple[int, int, int, bool, torch.Tensor]] = []
        self.dropped: set[int] = set()
        self.nbytes = 0
        self.pos = 0
        self.refs: list[Any] | None = None  # plan mode: the tensor of each take
        self.vers: list[int] | None = None  # plan mode, with version counters: their versions
        self.outs: list[Any] | None = None  # plan mode: vectors of tensors reduced in hooks
        self.split_out: Any = None  # plan mode: (SplitLayout, its vector) of reduce_on_device
        self.split_buf: np.ndarray | None = None  # plan mode: the split vector hooks reduce into
        self.state: np.ndarray | None = None  # plan mode: per take ST_* (hooks/fast_take.c)
        if self._cursor is not None:
            self._cursor.end()
        if getattr(self, "plan", None) is not None:
            self.plan = None

    def __len__(self) -> int:
        self._sync()
        return self.pos if self.plan is not None else len(self.recs)

    def _take_py(self, ci: int, mid: int, io: int, slot: int, t: torch.Tensor) -> None:
        """Hot path: one call per recorded tensor (through `take`)."""
        pl = self.plan
        if pl is not None:
            k = self.pos
            if (k < pl.n and pl.sig[k] == (((ci - self.first) * pl.n_mod + mid) * 2 + io)
                    * SLOTS + slot and t.shape == pl.shapes[k] and t.dtype is pl.dtypes[k]
                    and t.device == pl.devices[k]):
                s = pl.share[k]
                if s < 0 and pl.views[k] is None:  # a large tensor: reduced right here
                    self.outs[k] = reduce.fast_one(  # type: ignore[index]
                        t.detach(), *pl.reduced[k])
                    if self.track:
                        self.vers[k] = t._version  # type: ignore[index]
                    self.refs[k] = t  # type: ignore[index]
                    self.pos = k + 1
                    return
                if self.track:
                    ver = t._version
                    if s < 0:
                        d = pl.dst[k]
                        if d and t.is_contiguous():  # same shape, dtype, device: the bytes
                            memmove(d, t.data_ptr(), pl.size[k])
                        else:
                            pl.views[k].copy_(t if self.nograd else t.detach())
                        self.vers[k] = ver  # type: ignore[index]
                        self.refs[k] = t  # type: ignore[index]
                        self.pos = k + 1
                        return
                    if self.refs[s] is t and self.vers[s] == ver:  # type: ignore[index]
                        self.vers[k] = ver  # type: ignore[index]
                        self.refs[k] = t  # type: ignore[index]
                        self.pos = k + 1
                        return
                elif s < 0:
                    d = pl.dst[k]
                    if d and t.is_contiguous():
                        memmove(d, t.data_ptr(), pl.size[k])
                    else:
                        pl.views[k].copy_(t)
                    self.refs[k] = t  # type: ignore[index]
                    self.pos = k + 1
                    return
                elif self.refs[s] is t:  # type: ignore[index]
                    self.refs[k] = t  # type: ignore[index]
                    self.pos = k + 1
                    return
            self.leave_plan()
        j = self.uniq.get(id(t))
        if self.track:
            ver = t._version
            if j is None or (u := self.units[j])[0] is not t or ver != u[1]:
                j = self._new(t, ver)
        else:  # no version counters (inference mode): share only an input of back-to-back
            ver = -1  # calls (q/k/v, gate/up), never an output later read as an input
            if (j is None or (u := self.units[j])[0] is not t or io or u[1]
                    or ci - u[2] > 1):
                j = self._new(t, -1 if io else 0)
                u = self.units[j]
            u[2] = ci
        self.recs.append((ci, mid, io, slot, j, ver))

    def _new(self, t: torch.Tensor, ver: int) -> int:
        j = len(self.units)
        self.uniq[id(t)] = j
        key = (t.shape, t.dtype, t.device)
        numel = t.numel()
        if numel == 0 or t.is_meta:
            self.units.append([t, ver, -2, key, None])
            return j
        if numel <= self.clone_limit:
            self.units.append([t, ver, -2, key, t.clone() if self.nograd
                               else t.detach().clone()])
            g = self.groups.get(key)
            if g is None:
                self.groups[key] = [j]
            else:
                g.append(j)
        else:
            shape = key[0]
            chans = int(shape[-1]) if len(shape) else 1
            rows = numel // max(chans, 1)
            keep = self.keep and chans <= self.chan_limit
            # the original, for the exact pass and snapshots if this step fails
            self.units.append([t, ver, -2, key, t])
            self.singles.append((j, rows, chans, keep,
                                 reduce.fast_one(t.detach(), rows, chans, keep)))
        self.nbytes += numel * t.element_size()
        return j

    # -- plans ------------------------------------------------------------------------------
    def leave_plan(self) -> None:
        """The step stopped matching its plan: turn the takes so far into the generic state
        (their copies stay in the plan's buffers, which nothing rewrites before the step ends)
        and let the plan be rebuilt from this step."""
        self._sync()
        pl, n = self.plan, self.pos
        if pl is None:
            return
        if self._cursor is not None:
            self._cursor.end()
        refs, vers, outs = self.refs or [], self.vers, self.outs
        state, buf = self.state, self.split_buf
        self.plan = None
        self.refs = self.vers = self.outs = None
        self.state = self.split_buf = None
        self.missed = True
        unit_of: dict[int, int] = {}
        for i in range(n):
            rel, mid, io, slot = pl.meta[i]
            ci = self.first + rel
            t = refs[i]
            s = pl.share[i]
            ver = vers[i] if vers is not None else -1
            if s < 0:
                j = unit_of[i] = len(self.units)
                self.uniq[id(t)] = j
                key = pl.desc[int(pl.which[i])]
                uver = ver if vers is not None else (-1 if io else 0)
                red = pl.reduced[i]
                st = int(state[i]) if state is not None else ST_NONE
                self.units.append([t, uver, ci if vers is None else -2, key,
                                   t if red is not None else pl.views[i]])
                if red is not None:
                    self.singles.append((j, *red, outs[i]))  # type: ignore[index]
                elif st != ST_NONE:  # reduced in its hook: its figures, from the split vector
                    lay = pl.split
                    u = int(pl.which[i])
                    _, _, _, _, lo, _, _, rows, chans = lay.places[u]
                    self.carried.append((j, rows, chans, lo >= 0,
                                         lay.packed_of(buf, u, lo >= 0)))
                    if st == ST_REDUCED:  # never copied: its buffer row is not its tensor
                        self.dropped.add(j)
                else:
                    self.groups.setdefault(key, []).append(j)
                self.nbytes += t.numel() * t.element_size()
            else:
                j = unit_of[s]
                if vers is None:
                    self.units[j][2] = ci
            self.recs.append((ci, mid, io, slot, j, ver))

    def learn(self) -> None:
        """At the end of a step reduced in one go: keep its plan for the next step of its key
        (unless it ran on one, or plans keep missing for this key)."""
        if self.plan is not None:
            return
        key = self.key
        if self.missed:
            self.plans.pop(key, None)
            self._misses[key] = self._misses.get(key, 0) + 1
        if self._misses.get(key, 0) > MAX_MISSES or key in self.plans:
            return
        spent = sum(p.nbytes for p in self.plans.values())
        pl = build_plan(self.recs, self.units, self.singles, first_call=self.first,
                        n_mod=self.n_mod,
                        keep=self.keep, chan_limit=self.chan_limit,
                        budget=self.plan_budget - spent)
        if pl is None:
            return
        if len(self.plans) >= MAX_PLANS:
            self.plans.pop(next(iter(self.plans)))
        self.plans[key] = pl

    @property
    def on_plan(self) -> bool:
        """This step ran entirely on its plan so far."""
        return self.plan is not None

    # -- views for the end of the step (one pass each) --------------------------------------
    def settle(self) -> None:
        """Before the step's reduction: a step that took fewer tensors than its plan leaves
        it."""
        self._sync()
        if self.plan is not None and self.pos != self.plan.n:
            self.leave_plan()

    def record_arrays(self) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """(meta n x 4: call, module, io, slot), unique index per record, versions."""
        pl = self.plan
        if pl is not None:
            meta = pl.meta_rel.copy()
            meta[:, 0] += self.first
            return meta, pl.which, (self.vers if self.vers is not None else [-1] * pl.n)
        if not self.recs:
            return np.zeros((0, 4), np.int64), np.zeros(0, np.int64), []
        arr = np.array(self.recs, dtype=np.int64)
        return arr[:, :4], arr[:, 4].copy(), arr[:, 5].tolist()

    def record_tensors(self, which: np.ndarray) -> list[Any]:
        """The original tensor of each record (for its version now)."""
        if self.plan is not None:
            return list(self.refs or [])
        orig = self.column(0)
        return [orig[j] for j in which.tolist()]

    def column(self, k: int) -> list[Any]:
        """One field of every unique tensor (0 original, 1 version, 3 description, 4 seen)."""
        pl = self.plan
        if pl is not None:
            if k == 0:
                refs = self.refs or []
                return [refs[i] for i in pl.first_pos]
            if k == 1:
                vers = self.vers
                return [vers[i] for i in pl.first_pos] if vers is not None else [
                    0] * len(pl.first_pos)
            if k == 3:
                return pl.desc
            if k == 4:
                seen = pl.seen
                if pl.singles:
                    refs = self.refs or []
                    seen = [refs[pl.first_pos[j]] if v is None else v
                            for j, v in enumerate(seen)]
                if self.state is not None:  # reduced in the hook without a copy: not kept
                    gone = self.state[pl.first_pos_arr] == ST_REDUCED
                    seen = [None if g else v for v, g in zip(seen, gone.tolist())]
                return seen
            raise IndexError(k)
        if k == 4 and self.dropped:
            return [None if j in self.dropped else u[4] for j, u in enumerate(self.units)]
        return [u[k] for u in self.units]

    def described(self) -> tuple[np.ndarray, ...] | None:
        """Shape facts of the unique tensors when a plan holds them, else None."""
        return self.plan.described if self.plan is not None else None

    def reduce_on_device(self) -> tuple[list, dict[torch.device, list[torch.Tensor]]]:
        """Reduce the copies (batched per group) and gather the hook-time reductions:
        (plan, per-device packed vectors), plan rows (unique ids, rows, chans, keep, device,
        size) in the order of the packed vectors."""
        if self.plan is not None:
            pl = self.plan
            done = (self.state[pl.first_pos_arr] != ST_NONE if self.state is not None
                    else None)
            plan, per_dev, self.split_out = pl.reduce(self.outs or [], self.split_buf, done)
            return plan, per_dev
        plan: list = []
        per_dev: dict[torch.device, list[torch.Tensor]] = {}
        for j, rows, chans, keep, packed in self.singles + self.carried:
            per_dev.setdefault(packed.device, []).append(packed)
            plan.append((np.array([j], np.int64), rows, chans, keep, packed.device,
                         packed.numel()))
        src = self.column(4)
        for (shape, _dtype, _device), idx_l in self.groups.items():
            chans = int(shape[-1]) if len(shape) else 1
            numel = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
            rows = numel // max(chans, 1)
            keep = self.keep and chans <= self.chan_limit
            per = max(1, reduce.REDUCE_CHUNK_ELEMS // max(numel, 1))  # bounded stacks
            for k in range(0, len(idx_l), per):
                sub = idx_l[k:k + per]
                packed = reduce.fast_group([src[j] for j in sub], rows, chans, keep)
                per_dev.setdefault(packed.device, []).append(packed)
                plan.append((np.array(sub, np.int64), rows, chans, keep, packed.device,
                             packed.numel()))
        return plan, per_dev
