"""Parameters watched during the run: a weight or scale overwritten mid-run (a kernel's stray
store, a bad in-place update) is named with its tensor, rows and the first step it was seen.

The attach-time health (hooks/params.py) sees a tensor once. This rechecks the same floating-
point tensors of the hooked GEMM modules (weights, biases, scales; and the token embedding) at
the end of a step:
- every `every` steps (capture's `param_watch`, default 256),
- at once when the step's records or logits hold NaN/Inf (the first such step after a finite
  one: the run already went bad, a sync there is fine),
- and at close.

A check is one reduction per tensor into ONE preallocated buffer per device: the float32 sum of
the tensor, which is finite exactly when every value is (a NaN or Inf makes it NaN / Inf; a
finite sum of finite weights cannot overflow float32 in practice, and if one did the exact pass
below finds nothing and no row is written). float8 tensors count their NaN/Inf bit patterns.
On an accelerator the buffer is copied to pinned host memory without waiting and read at the
next check (one check late), so a normal step never synchronizes; a trigger reads it at once.

Only tensors whose probe is not finite get the exact pass: params.param_health (the counts,
the first bad value's row, column and group: the same code as at attach) and the bad rows
(one vectorized `any` over dim 1). One row per tensor goes to /param_watch, at the first check
that saw it (trace/schema.py PARAM_WATCH_COLUMNS). Integer tensors (packed weights, zero
points) cannot hold NaN/Inf and are not watched; their scales are.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import torch
from torch import nn

from qforensics.formats import GEMM_KINDS
from qforensics.hooks.modules import HEALTH_PARAMS, quant_meta, input_embedding
from qforensics.hooks.params import param_health
from qforensics.trace import schema

__all__ = ["DEFAULT_EVERY", "ParamWatch", "watched_tensors"]

log = logging.getLogger("qforensics.hooks.capture")

DEFAULT_EVERY = 256  # steps between two checks (bench/param_health_cost.py measures the cost)
_ROWS = 8  # bad rows kept per tensor (schema: rows i8 (8,))
_FP8_NONFINITE = {torch.float8_e4m3fn: (0x7F, 0x7F), torch.float8_e5m2: (0x7C, 0x7C)}


def watched_tensors(chosen: list[tuple[str, nn.Module, str]], root: nn.Module
                    ) -> list[tuple[int, str, str, torch.Tensor, int | None]]:
    """(module_id, module, param, tensor, group) for each floating-point tensor the attach-time
    health checks (hooks/modules.py: the health parameters of the GEMM modules, with the
    quantization group it reads), and the token embedding's weight (module id -1: not hooked);
    each storage once (a tied lm_head / embedding: the first name)."""
    out: list[tuple[int, str, str, torch.Tensor, int | None]] = []
    seen: set[tuple] = set()

    def add(mid: int, name: str, pname: str, t: Any, group: Any) -> None:
        if (not isinstance(t, torch.Tensor) or t.is_meta or not t.numel()
                or not t.is_floating_point()):
            return
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key in seen:
            return
        seen.add(key)
        out.append((mid, name, pname, t.detach(), group if isinstance(group, int) else None))

    for mid, (name, mod, kind) in enumerate(chosen):
        if kind not in GEMM_KINDS:
            continue
        group = (quant_meta(mod) or {}).get("group_size")
        for pname, t in list(mod.named_parameters(recurse=False)) + list(
                mod.named_buffers(recurse=False)):
            if pname in HEALTH_PARAMS:
                add(mid, name, pname, t, group)
    emb = input_embedding(root)
    if emb is not None:
        add(-1, emb[0], "weight", getattr(emb[1], "weight", None), None)
    return out


class _Device:
    """The watched tensors of one device and their probe buffer."""

    def __init__(self, idx: list[int], tensors: list[torch.Tensor]) -> None:
        self.idx = np.asarray(idx, np.int64)
        self.tensors = tensors
        dev = tensors[0].device
        self.probe = torch.zeros(len(tensors), dtype=torch.float32, device=dev)
        self.host = self.probe if dev.type == "cpu" else torch.zeros(
            len(tensors), dtype=torch.float32, pin_memory=torch.cuda.is_available())
        self.event: Any = None
        self.fp8 = [t.dtype in _FP8_NONFINITE for t in tensors]

    def launch(self) -> None:
        """One reduction per tensor into the probe buffer; on an accelerator, an async copy to
        pinned memory and an event (nothing waits)."""
        parts = []
        for t, f8 in zip(self.tensors, self.fp8):
            if f8:  # count of NaN/Inf bit patterns: finite when 0 (read below)
                mask, want = _FP8_NONFINITE[t.dtype]
                parts.append(((t.view(torch.uint8) & mask) == want).sum(dtype=torch.float32))
            else:
                parts.append(t.sum(dtype=torch.float32))
        with torch.no_grad():
            torch.stack(parts, out=self.probe)
            if self.host is not self.probe:
                self.host.copy_(self.probe, non_blocking=True)
                self.event = torch.cuda.Event() if self.probe.device.type == "cuda" else None
                if self.event is not None:
                    self.event.record()

    def suspects(self, wait: bool) -> np.ndarray | None:
        """Watched indices whose probe says NaN/Inf; None when the copy has not landed and
        `wait` is False."""
        if self.event is not None:
            if not wait and not self.event.query():
                return None
            self.event.synchronize()
        v = self.host.numpy()
        bad = ~np.isfinite(v) | (np.asarray(self.fp8, bool) & (v > 0))
        return self.idx[bad]


class ParamWatch:
    """Owned by the capture session; `step_end` and `close` return /param_watch rows."""

    def __init__(self, watched: list[tuple[int, str, str, torch.Tensor, int | None]],
                 every: int) -> None:
        self.watched = watched
        self.every = max(1, int(every))
        by_dev: dict[torch.device, list[int]] = {}
        for i, w in enumerate(watched):
            by_dev.setdefault(w[3].device, []).append(i)
        self._devs = [_Device(ix, [watched[i][3] for i in ix]) for ix in by_dev.values()]
        self._host_only = all(d.host is d.probe for d in self._devs)
        self._pending_step: int | None = None  # the step whose probes are in flight
        self._last_ok = -1  # the last step a check read finite for every tensor not yet found
        self._found: set[int] = set()
        self._prev_bad = False
        self.checks = 0
        # rows the interval checks found, not yet handed to a step's batch (`tick`); the
        # lock: `tick` runs on the model's thread, `step_end` where records are built
        self._ready = _EMPTY
        self._lock = threading.Lock()

    def tick(self, step: int) -> None:
        """At the end of every step, on the model's thread, whenever its records are built: the
        interval check, launched at the steps it is due (every N), so that it reads the
        parameters as that step left them. A CPU reads it at once; an accelerator at the next
        check or step end that finds its copy landed (a launch still in flight: this one is
        skipped, never waited for)."""
        if (step + 1) % self.every:
            return
        with self._lock:
            if self._pending_step is not None:
                self._ready = _cat(self._ready, self._collect(wait=False, trigger="interval"))
                if self._pending_step is not None:
                    return
            self._launch(step)
            if self._host_only:  # nothing in flight on a CPU: read it now, at no extra cost
                self._ready = _cat(self._ready, self._collect(wait=True, trigger="interval"))

    def step_end(self, step: int, nonfinite: bool, now: int | None = None) -> np.ndarray:
        """When `step`'s records are built (at its end, or late in compiled mode): the rows the
        interval checks found (`tick`), and at once a check when the step's records or
        logits hold NaN/Inf; rows for tensors first seen non-finite. `now`: the latest step
        the model has run, where records are built late (compiled mode emits steps in
        batches, or a step late from its drainer thread): that check reads the parameters as
        they are then, so its rows are labelled with that step, never with an earlier one the
        parameters may not yet have been overwritten at."""
        trigger = nonfinite and not self._prev_bad
        self._prev_bad = nonfinite
        with self._lock:
            if not (trigger or self._pending_step is not None or len(self._ready)):
                return _EMPTY
            rows, self._ready = self._ready, _EMPTY
            rows = _cat(rows, self._collect(wait=trigger, trigger="interval"))
            if trigger:
                self._launch(step if now is None else max(step, int(now)))
                rows = _cat(rows, self._collect(wait=True, trigger="nonfinite"))
            return rows

    def close(self, step: int) -> np.ndarray:
        """The last check (at close): what is in flight, then the parameters as they end."""
        with self._lock:
            rows, self._ready = self._ready, _EMPTY
            rows = _cat(rows, self._collect(wait=True, trigger="interval"))
            if step < 0 or not self._devs:
                return rows
            self._launch(step)
            return _cat(rows, self._collect(wait=True, trigger="close"))

    def _launch(self, step: int) -> None:
        for d in self._devs:
            d.launch()
        self._pending_step = step
        self.checks += 1

    def _collect(self, wait: bool, trigger: str) -> np.ndarray:
        step = self._pending_step
        if step is None:
            return _EMPTY
        hits: list[int] = []
        for d in self._devs:
            s = d.suspects(wait)
            if s is None:
                return _EMPTY  # still in flight: read at the next step end
            hits.extend(int(i) for i in s if int(i) not in self._found)
        self._pending_step = None
        out = [r for r in (self._exact(i, step, trigger) for i in hits) if r is not None]
        self._last_ok = step
        return np.concatenate(out) if out else _EMPTY

    def _exact(self, i: int, step: int, trigger: str) -> np.ndarray | None:
        """The row for tensor i (None when the exact pass finds it finite after all)."""
        mid, module, pname, t, group = self.watched[i]
        with torch.no_grad():
            x = t.view(torch.uint8) if t.dtype in _FP8_NONFINITE else t
            if t.dtype in _FP8_NONFINITE:
                mask, want = _FP8_NONFINITE[t.dtype]
                bad = (x & mask) == want
                h = {"numel": t.numel(), "nan": int(bad.count_nonzero()), "inf": 0}
            else:
                h = param_health(t, pname, group=group)
                bad = None
            if not (h.get("nan") or h.get("inf")):
                return None
            if bad is None:
                bad = ~torch.isfinite(t)
            per_row = (bad.reshape(bad.shape[0], -1).any(dim=1) if bad.dim() >= 2
                       else bad.reshape(-1))
            n_rows = int(per_row.count_nonzero())
            first = per_row.nonzero().reshape(-1)[:_ROWS].tolist()
        self._found.add(i)
        row = np.zeros(1, schema.param_watch_dtype())
        row["step"], row["last_finite"], row["module_id"] = step, self._last_ok, mid
        row["module"] = module.encode("utf-8", "replace")[:128]
        row["param"] = pname.encode("utf-8", "replace")[:32]
        row["trigger"] = trigger.encode()
        row["numel"], row["nan"], row["inf"] = int(t.numel()), h["nan"], h["inf"]
        row["n_rows"] = n_rows
        row["rows"] = -1
        row["rows"][0, :len(first)] = first
        where = h.get("first_nonfinite") or {}
        row["col"] = where.get("col", -1) if t.dim() >= 2 else -1
        row["group"] = where.get("group", -1)
        log.warning("qforensics: %s.%s holds %d NaN / %d Inf at the end of step %d (%d rows, "
                    "first %s)", module, pname, h["nan"], h["inf"], step, n_rows, first[:4])
        return row


_EMPTY = np.zeros(0, schema.param_watch_dtype())


def _cat(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return b if not len(a) else a if not len(b) else np.concatenate([a, b])
