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

from typing import Any

import numpy as np
import torch

from qforensics.hooks import reduce

# A tensor with at most this many elements is copied at hook time and reduced with others of
# its shape at the end of the step; a larger one is reduced in the hook.
CLONE_LIMIT = 1 << 16


class PendingStep:
    """Records (call, module, io, slot -> unique tensor) and the unique tensors of one step."""

    __slots__ = ("recs", "units", "uniq", "groups", "singles", "nbytes", "keep", "chan_limit",
                 "track", "nograd", "clone_limit")

    def __init__(self, clone_limit: int = CLONE_LIMIT) -> None:
        self.clone_limit = clone_limit
        self.keep = True
        self.chan_limit = 8192
        self.track = True
        self.nograd = False  # autograd off: a copy needs no detach
        self.clear()

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
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.recs)

    def take(self, ci: int, mid: int, io: int, slot: int, t: torch.Tensor) -> None:
        """Hot path: one call per recorded tensor."""
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

    # -- views for the end of the step (one pass each) --------------------------------------
    def record_arrays(self) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """(meta n x 4: call, module, io, slot), unique index per record, versions."""
        if not self.recs:
            return np.zeros((0, 4), np.int64), np.zeros(0, np.int64), []
        arr = np.array(self.recs, dtype=np.int64)
        return arr[:, :4], arr[:, 4].copy(), arr[:, 5].tolist()

    def column(self, k: int) -> list[Any]:
        """One field of every unique tensor (0 original, 1 version, 3 description, 4 seen)."""
        return [u[k] for u in self.units]

    def reduce_on_device(self) -> tuple[list, dict[torch.device, list[torch.Tensor]]]:
        """Reduce the copies (batched per group) and gather the hook-time reductions:
        (plan, per-device packed vectors), plan rows (unique ids, rows, chans, keep, device,
        size) in the order of the packed vectors."""
        plan: list = []
        per_dev: dict[torch.device, list[torch.Tensor]] = {}
        for j, rows, chans, keep, packed in self.singles:
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
