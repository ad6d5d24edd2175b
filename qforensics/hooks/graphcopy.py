"""A GPU's host copies of the device ring (GraphStats' mixin): after each step the model's
thread queues the copies of the step's slot, its token rows, the first-failure word, the last
logits row and the input ids into pinned buffers of the step's host slot, on the stream, with no
kernel and no sync; the records are built from those copies a step later or by the drainer
thread (hooks/graphread.py reads them). On the CPU the ring is read in place, and these copies
run only as the GPU path's stand-in (graphstats.HOST_COPIES_ON_CPU).

A step's copies are a handful of `copy_` calls: the views they copy between are made once per
(slot, token slot, host slot, rows) and kept (`_plans`), since each view costs a dispatch and
the step's host time is what a CUDA-graphed decode step of ~2 ms feels.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

MAX_IDS = 65536  # input ids kept per step (as the eager capture keeps)


class _Done:
    """The event of a copy on the CPU (`HOST_COPIES_ON_CPU`): done when made."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class HostCopies:
    # GraphStats' state this mixin reads and writes (set up in its __init__)
    device: torch.device
    copies: bool  # the GPU's way: each step's slot read from its host copy
    slots: int
    host_slots: int
    tok_rows: int
    toks: torch.Tensor
    first: torch.Tensor
    segments: list[torch.Tensor]
    _used: list[int]
    _host: dict[int, list[torch.Tensor]]
    _plans: dict[tuple[int, int, int, int], tuple[Any, list[int], list[Any]]]
    _views: dict[tuple[int, int, int, torch.dtype], torch.Tensor]  # `_dst`'s
    _event: dict[int, Any]
    _copied: dict[int, int]
    _tok_copied: dict[int, int]
    _first_host: dict[int, torch.Tensor]
    _first_np: dict[int, np.ndarray]
    _lrow: dict[int, torch.Tensor]
    _lrow_n: dict[int, int]
    _ids: dict[int, torch.Tensor]
    ids_n: dict[int, int]

    def put_step_extras(self, step: int, row: torch.Tensor | None,
                        ids: torch.Tensor | None) -> None:
        """The last logits row and the input ids of `step`, read when it is emitted: the row
        copied as it is now into a host buffer of its host slot (on a GPU pinned, the copy
        queued on the stream: one transfer, no sync, no kernel; the figures are computed on
        the host, off the hot path), the ids likewise (at most MAX_IDS)."""
        hs = step % self.host_slots
        self._lrow_n[hs] = 0
        if row is not None:
            flat = row if row.dim() == 1 else row.reshape(-1)
            n = flat.numel()
            self._dst(self._lrow, hs, n, flat.dtype, n).copy_(flat, non_blocking=True)
            self._lrow_n[hs] = n
        n = 0
        if ids is not None:
            flat = ids if ids.dim() == 1 else ids.reshape(-1)
            n = flat.numel()
            if n > MAX_IDS:
                n, flat = MAX_IDS, flat[:MAX_IDS]
            # the ids' own dtype: no conversion
            self._dst(self._ids, hs, n, flat.dtype, MAX_IDS).copy_(flat, non_blocking=True)
        self.ids_n[hs] = n

    def _dst(self, bufs: dict[int, torch.Tensor], hs: int, n: int, dtype: torch.dtype,
             size: int) -> torch.Tensor:
        """The first `n` elements of host slot `hs`'s buffer in `bufs` (allocated once per
        slot, at least `size`, pinned on a GPU), a view kept for the next step of that size."""
        key = (id(bufs), hs, n, dtype)
        v = self._views.get(key)
        if v is None:
            buf = bufs.get(hs)
            if buf is None or buf.numel() < max(n, size) or buf.dtype != dtype:
                buf = bufs[hs] = torch.empty(max(n, size), dtype=dtype,
                                             pin_memory=self.device.type == "cuda")
                for k in [k for k in self._views if k[:2] == (id(bufs), hs)]:
                    del self._views[k]  # views of the buffer it replaced
            if len(self._views) > 1024:  # steps of many sizes (an engine's batches)
                self._views.clear()
            v = self._views[key] = buf[:n]
        return v

    def start_copy(self, step: int, rows: int | None = None) -> None:
        """After the step (on a GPU): its slot of every segment, its first `rows` token rows
        (None: all; the host knows a step's tokens, the entries' rows are those) and the
        first-failure word, copied asynchronously into pinned host buffers allocated once per
        slot (the token rows' grown when a step has more), then the event that also covers
        `put_step_extras`' copies (made before this); read in `collect`. On CPU: nothing
        (collect reads the ring in place)."""
        if not self.copies:
            return
        slot, hs = step % self.slots, step % self.host_slots
        pin = self.device.type == "cuda"
        t_rows = self.tok_rows if rows is None else max(1, min(int(rows), self.tok_rows))
        ncol = self.toks.shape[2]
        host = self._host.get(hs)
        if host is None or len(host) != len(self.segments) + 1 or any(
                h.numel() < used for h, used in zip(host, self._used)):
            host = self._host[hs] = [  # as much as the entries use: slots x segments
                torch.empty(max(1, used), dtype=torch.float32, pin_memory=pin)
                for used in self._used] + [torch.empty(0, dtype=torch.float32)]
        if host[-1].numel() < t_rows * ncol:  # grown to the most rows a step had (rare)
            host[-1] = torch.empty(max(t_rows, min(64, self.tok_rows)) * ncol,
                                   dtype=torch.float32, pin_memory=pin)
            self._plans.clear()
        ts = step % self.toks.shape[0]
        plan = self._plans.get((slot, ts, hs, t_rows))
        if plan is None or plan[0] is not host or plan[1] != self._used:
            if len(self._plans) > 512:  # steps of many sizes (an engine's prefills)
                self._plans.clear()
            pairs = [(dst[:used], seg[slot, :used])
                     for dst, seg, used in zip(host, self.segments, self._used)]
            pairs.append((host[-1][:t_rows * ncol], self.toks[ts, :t_rows].reshape(-1)))
            plan = self._plans[(slot, ts, hs, t_rows)] = (host, list(self._used), pairs)
        for dst, src in plan[2]:
            dst.copy_(src, non_blocking=True)
        self._tok_copied[hs] = t_rows
        word = self._first_host.get(hs)
        if word is None:
            word = self._first_host[hs] = torch.empty(1, dtype=torch.int64, pin_memory=pin)
            self._first_np[hs] = word.numpy()  # read each step: no tensor indexing then
        word.copy_(self.first, non_blocking=True)
        ev = self._event.get(hs)
        if ev is None:
            ev = self._event[hs] = torch.cuda.Event() if pin else _Done()
        ev.record()
        self._copied[hs] = step

    def _host_slot(self, step: int) -> list[np.ndarray]:
        """The host copy of `step`'s slot (a GPU), its copy started if it was not."""
        hs = step % self.host_slots
        if self._copied.get(hs) != step:
            self.start_copy(step)
        self._event[hs].synchronize()  # one step late: long done
        return [h.numpy() for h in self._host[hs]]
