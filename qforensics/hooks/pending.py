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

    __slots__ = ("meta", "which", "versions", "uver", "ulast", "uniq", "src", "orig", "desc", "groups", "singles",
                 "nbytes", "keep", "chan_limit", "track", "clone_limit")

    def __init__(self, clone_limit: int = CLONE_LIMIT) -> None:
        self.clone_limit = clone_limit
        self.keep = True
        self.chan_limit = 8192
        self.track = True
        self.clear()

    def clear(self) -> None:
        self.meta: list[tuple[int, int, int, int]] = []  # call_index, module_id, io, slot
        self.which: list[int] = []  # record -> unique index
        self.versions: list[int] = []  # record -> the tensor's version when its hook ran
        self.uver: list[int] = []  # unique -> its version when first seen
        self.ulast: list[int] = []  # unique -> last call that took it (inference mode)
        self.uniq: dict[int, int] = {}  # id(tensor) -> unique index (the tensor is held in orig)
        self.src: list[Any] = []  # unique -> the tensor as the hook saw it (copy or original)
        self.orig: list[torch.Tensor] = []  # unique -> the original (keeps ids stable)
        self.desc: list[tuple[Any, Any, Any]] = []  # unique -> (shape, dtype, device)
        self.groups: dict[Any, list[int]] = {}  # (shape, dtype, device) -> uniques copied
        self.singles: list[tuple[int, int, int, bool, torch.Tensor]] = []  # reduced in the hook
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.meta)

    def take(self, ci: int, mid: int, io: int, slot: int, t: torch.Tensor) -> None:
        """Hot path: one call per recorded tensor."""
        if self.track:
            ver = t._version
            j = self.uniq.get(id(t))
            if j is None or self.orig[j] is not t or ver != self.uver[j]:
                j = self._new(t, ver)
        else:  # no version counters (inference mode): share only an input of back-to-back
            ver = -1  # calls (q/k/v, gate/up), never an output later read as an input
            j = self.uniq.get(id(t))
            if (j is None or self.orig[j] is not t or io != 0 or self.uver[j] != 0
                    or ci - self.ulast[j] > 1):
                j = self._new(t, -1 if io else 0)
            self.ulast[j] = ci
        self.meta.append((ci, mid, io, slot))
        self.which.append(j)
        self.versions.append(ver)

    def _new(self, t: torch.Tensor, ver: int) -> int:
        j = len(self.orig)
        self.uniq[id(t)] = j
        self.orig.append(t)
        self.uver.append(ver)
        self.ulast.append(-2)
        shape, dtype, device = t.shape, t.dtype, t.device
        self.desc.append((shape, dtype, device))
        numel = t.numel()
        if device.type == "meta" or numel == 0:
            self.src.append(None)
            return j
        nbytes = numel * t.element_size()
        if numel <= self.clone_limit:
            self.src.append(t.detach().clone())
            key = (shape, dtype, device)
            g = self.groups.get(key)
            if g is None:
                self.groups[key] = [j]
            else:
                g.append(j)
        else:
            chans = int(shape[-1]) if len(shape) else 1
            rows = numel // max(chans, 1)
            keep = self.keep and chans <= self.chan_limit
            self.src.append(t)  # for the exact pass and snapshots, if this step fails
            self.singles.append((j, rows, chans, keep,
                                 reduce.fast_one(t.detach(), rows, chans, keep)))
        self.nbytes += nbytes
        return j

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
        src = self.src
        for (shape, _dtype, _device), idx_l in self.groups.items():
            chans = int(shape[-1]) if len(shape) else 1
            numel = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
            rows = numel // max(chans, 1)
            keep = self.keep and chans <= self.chan_limit
            packed = reduce.fast_group([src[j] for j in idx_l], rows, chans, keep)
            per_dev.setdefault(packed.device, []).append(packed)
            plan.append((np.array(idx_l, np.int64), rows, chans, keep, packed.device,
                         packed.numel()))
        return plan, per_dev
