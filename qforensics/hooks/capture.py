"""`qforensics.capture(model, "trace.h5")`: forward hooks that stream per-call statistics into an
HDF5 trace.

How it stays fast: a hook does no tensor math at all. It numbers the call, keeps a reference to
each input/output tensor (with its in-place version counter) and returns. At the end of the step
(one top-level forward of the captured model), the pending tensors are grouped by shape, dtype
and device, stacked, and reduced in a few batched ops on their own device; everything the step
produced goes to the host in ONE transfer per device. A long prefill that would hold more than
`pending_budget` bytes is reduced early, in the same batched way.

Hooks are global state: `capture` attaches in `__enter__`, removes every handle in `finally`,
refuses to attach twice to the same model and never writes attributes onto the user's modules
(names are bound with functools.partial). Nothing here may crash the host run: an internal error
is logged once and capture degrades (stops recording) while the run goes on.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import threading
import time
import weakref
from functools import partial
from typing import Any, Callable, Iterable

import numpy as np
import torch
from torch import nn

from qforensics.errors import CaptureError
from qforensics.hooks.environment import describe_environment, rank_and_world
from qforensics.hooks.modules import ModuleFilter, describe_module, select_modules
from qforensics.trace import schema
from qforensics.trace.writer import StepBatch, TraceWriter

log = logging.getLogger(__name__)

_ACTIVE: dict[int, "Capture"] = {}  # id(model) -> capture: refuse attaching twice
_ACTIVE_LOCK = threading.Lock()

_DTYPE_CODE = {
    torch.float32: schema.DTYPE_CODES["float32"],
    torch.float16: schema.DTYPE_CODES["float16"],
    torch.bfloat16: schema.DTYPE_CODES["bfloat16"],
    torch.float64: schema.DTYPE_CODES["float64"],
    torch.float8_e4m3fn: schema.DTYPE_CODES["float8_e4m3fn"],
    torch.float8_e5m2: schema.DTYPE_CODES["float8_e5m2"],
    torch.bool: schema.DTYPE_CODES["bool"],
}
_HIDDEN_KWARGS = ("hidden_states", "input", "x", "inputs_embeds")
_MAX_INPUTS = 4
_MAX_OUTPUTS = 2
_MAX_NONFINITE_POSITIONS = 256


def _dtype_code(dt: torch.dtype) -> int:
    code = _DTYPE_CODE.get(dt)
    if code is not None:
        return code
    if not dt.is_floating_point and not dt.is_complex:
        return schema.DTYPE_CODES["int"]
    return schema.DTYPE_CODES["other"]


def _parse_steps(spec: str | Iterable[int] | Callable[[int], bool] | None) -> Callable[[int], bool]:
    """channel_steps: None/"all", "none", "0-3,8,16" style ranges, an iterable, or a callable."""
    if spec is None or spec == "all":
        return lambda s: True
    if spec == "none":
        return lambda s: False
    if callable(spec):
        return spec
    if isinstance(spec, str):
        chosen: set[int] = set()
        open_from: int | None = None
        for part in spec.split(","):
            part = part.strip()
            if not part:
                continue
            if part.endswith("-"):
                open_from = int(part[:-1])
            elif "-" in part:
                a, b = part.split("-", 1)
                chosen.update(range(int(a), int(b) + 1))
            else:
                chosen.add(int(part))
        return lambda s: s in chosen or (open_from is not None and s >= open_from)
    chosen = {int(s) for s in spec}
    return lambda s: s in chosen


def _first_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, dict):  # ModelOutput is a dict subclass
        v = obj.get("logits")
        if isinstance(v, torch.Tensor):
            return v
        for v in obj.values():
            if isinstance(v, torch.Tensor):
                return v
    if isinstance(obj, (tuple, list)):
        for v in obj:
            if isinstance(v, torch.Tensor):
                return v
    return None


class _Pending:
    """Tensors held until the step's batched reduction."""

    __slots__ = ("meta", "tensors", "versions", "nbytes")

    def __init__(self) -> None:
        self.meta: list[tuple[int, int, int, int]] = []  # call_index, module_id, io, slot
        self.tensors: list[torch.Tensor] = []
        self.versions: list[int] = []
        self.nbytes = 0

    def clear(self) -> None:
        self.meta = []
        self.tensors = []
        self.versions = []
        self.nbytes = 0


class Capture:
    """A capture session on one model. Create with `qforensics.capture(...)`."""

    def __init__(
        self,
        model: nn.Module,
        path: str | os.PathLike[str],
        *,
        modules: str | Iterable[str] | ModuleFilter | None = None,
        flush_interval: float = 1.0,
        channel_dtype: str = "float32",
        channel_limit: int = 8192,
        channel_steps: str | Iterable[int] | Callable[[int], bool] | None = None,
        channel_io: str = "all",
        snapshot_budget: int = 64 << 20,
        snapshot_tile_rows: int = 256,
        outlier_threshold: float = 448.0,
        pending_budget: int = 256 << 20,
        metadata: dict[str, Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise CaptureError(f"capture needs a torch.nn.Module, got {type(model).__name__}")
        if flush_interval <= 0:
            raise CaptureError("flush_interval must be positive (seconds)")
        if channel_io not in ("all", "inputs", "none"):
            raise CaptureError("channel_io must be 'all', 'inputs' or 'none'")
        env_rank, env_world = rank_and_world()
        self.rank = env_rank if rank is None else int(rank)
        self.world_size = env_world if world_size is None else int(world_size)
        self.path = self._resolve_path(os.fspath(path))
        self.model = model
        self._module_spec = modules
        self.options = {
            "flush_interval": float(flush_interval),
            "channel_dtype": str(channel_dtype),
            "channel_limit": int(channel_limit),
            "channel_steps": channel_steps if isinstance(channel_steps, str) or channel_steps is None
            else "custom",
            "channel_io": channel_io,
            "snapshot_budget": int(snapshot_budget),
            "snapshot_tile_rows": int(snapshot_tile_rows),
            "outlier_threshold": float(outlier_threshold),
            "pending_budget": int(pending_budget),
            "modules": modules if isinstance(modules, str) or modules is None else "custom",
        }
        self._channel_step = _parse_steps(channel_steps)
        self._metadata = dict(metadata or {})
        self._handles: list[Any] = []
        self._writer: TraceWriter | None = None
        self._attached = False
        self._degraded: str | None = None
        self._lock = threading.RLock()
        # run state
        self.step = -1
        self._in_step = False
        self._root_depth = 0
        self._next_call = 0
        self._step_first_call = 0
        self._step_t0 = 0.0
        self._step_ids: torch.Tensor | None = None
        self._logits: torch.Tensor | None = None
        self._pending = _Pending()
        self._track_versions = True
        self._partial: list[dict[str, np.ndarray]] = []  # reduced early within this step
        self._snap_bytes = 0
        self._snapped: set[str] = set()  # reasons already snapshotted
        self._snap_rows: list[np.ndarray] = []
        self._incidents: list[np.ndarray] = []
        self._snap_data: list[np.ndarray] = []
        self._names: list[str] = []
        self._kinds: list[str] = []
        self._modules: list[nn.Module] = []
        self._gemm_ids = np.zeros(0, np.int64)

    # -- set-up ------------------------------------------------------------------------------
    def _resolve_path(self, path: str) -> str:
        if "{rank}" in path:
            return path.format(rank=self.rank)
        if self.world_size > 1:
            root, ext = os.path.splitext(path)
            return f"{root}-{self.rank}{ext or '.h5'}"
        return path

    def __enter__(self) -> "Capture":
        self.attach()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        status: dict[str, Any] = {"state": "complete"}
        if exc is not None:
            status = {"state": "error", "error": f"{exc_type.__name__}: {exc}"[:2000]}
        self.close(status)

    def attach(self) -> None:
        with _ACTIVE_LOCK:
            if id(self.model) in _ACTIVE:
                raise CaptureError(
                    f"a capture is already attached to this {type(self.model).__name__}; "
                    "close it before attaching another"
                )
            _ACTIVE[id(self.model)] = self
        try:
            chosen = select_modules(self.model, self._module_spec)
            if len(chosen) <= 1:
                raise CaptureError(
                    f"nothing to hook in {type(self.model).__name__}: no Linear-like modules or "
                    "decoder blocks matched (pass modules=[...] to choose)"
                )
            descr = [describe_module(n, m, k) for n, m, k in chosen]
            self._names = [n for n, _, _ in chosen]
            self._kinds = [k for _, _, k in chosen]
            self._modules = [m for _, m, _ in chosen]
            self._gemm_ids = np.array([i for i, k in enumerate(self._kinds)
                                       if k in ("linear", "quantized_linear")], np.int64)
            env = describe_environment(self.model, self.rank, self.world_size)
            env.update({k: v for k, v in self._metadata.items()})
            self._writer = TraceWriter(
                self.path, modules=descr, environment=env, capture_options=self.options,
                channel_dtype=self.options["channel_dtype"],
                flush_interval=self.options["flush_interval"],
            )
            root_id = len(chosen) - 1
            for mid, (name, mod, kind) in enumerate(chosen):
                if kind == "root":
                    continue
                self._handles.append(mod.register_forward_hook(
                    partial(self._on_call, mid, kind == "block"), with_kwargs=True,
                    always_call=True))
            self._handles.append(self.model.register_forward_pre_hook(
                self._on_root_pre, with_kwargs=True))
            self._handles.append(self.model.register_forward_hook(
                partial(self._on_root_post, root_id), with_kwargs=True, always_call=True))
            self._attached = True
            _register_exit(self)
        except BaseException:
            self._remove_hooks()
            with _ACTIVE_LOCK:
                _ACTIVE.pop(id(self.model), None)
            if self._writer is not None:
                self._writer.close({"state": "error", "error": "attach failed"})
            raise

    # -- the hooks (hot path) ----------------------------------------------------------------
    def _on_root_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._degraded:
            return
        try:
            self._root_depth += 1
            if self._root_depth > 1:
                return  # re-entrant call of the root: same step
            if self._in_step:  # calls arrived before this forward: close that implicit step
                self._end_step(complete=True)
            ids = kwargs.get("input_ids")
            if not isinstance(ids, torch.Tensor):
                ids = next((a for a in args if isinstance(a, torch.Tensor)), None)
            self._begin_step(ids if isinstance(ids, torch.Tensor) and not ids.is_floating_point()
                             else None)
        except Exception as exc:
            self._degrade(exc)

    def _on_root_post(self, root_id: int, module: nn.Module, args: tuple, kwargs: dict,
                      output: Any) -> None:
        if self._degraded:
            return
        try:
            self._root_depth = max(0, self._root_depth - 1)
            if self._root_depth > 0:
                return
            if not self._in_step:
                self._begin_step(None)
            logits = _first_tensor(output)
            if logits is not None:
                self._add(self._next_call, root_id, schema.IO_OUTPUT, 0, logits)
                self._next_call += 1
                if logits.is_floating_point() and logits.numel() and not logits.is_meta:
                    self._logits = logits
            self._end_step(complete=output is not None)
        except Exception as exc:
            self._degrade(exc)

    def _on_call(self, mid: int, is_block: bool, module: nn.Module, args: tuple, kwargs: dict,
                 output: Any) -> None:
        if self._degraded:
            return
        try:
            ci = self._next_call
            self._next_call = ci + 1
            if not self._in_step:
                self._begin_step(None)
            found: list[tuple[int, int, torch.Tensor]] = []  # (io, slot, tensor)
            limit = 1 if is_block else _MAX_INPUTS
            for a in args:
                if isinstance(a, torch.Tensor):
                    found.append((0, len(found), a))
                    if len(found) >= limit:
                        break
            if not found and kwargs:
                for k in _HIDDEN_KWARGS:
                    a = kwargs.get(k)
                    if isinstance(a, torch.Tensor):
                        found.append((0, 0, a))
                        break
            if isinstance(output, torch.Tensor):
                found.append((1, 0, output))
            elif output is not None:
                if isinstance(output, (tuple, list)):
                    slot = 0
                    for o in output:
                        if isinstance(o, torch.Tensor):
                            found.append((1, slot, o))
                            slot += 1
                            if is_block or slot >= _MAX_OUTPUTS:
                                break
                else:
                    o = _first_tensor(output)
                    if o is not None:
                        found.append((1, 0, o))
            p = self._pending
            track = self._track_versions
            for io, slot, t in found:
                p.meta.append((ci, mid, io, slot))
                p.tensors.append(t)
                p.versions.append(t._version if track else -1)
                p.nbytes += t.nelement() * t.element_size()
            if p.nbytes > self.options["pending_budget"]:
                self._reduce_pending()
        except Exception as exc:
            self._degrade(exc)

    def _add(self, ci: int, mid: int, io: int, slot: int, t: torch.Tensor) -> None:
        p = self._pending
        p.meta.append((ci, mid, io, slot))
        p.tensors.append(t)
        p.versions.append(t._version if self._track_versions else -1)
        p.nbytes += t.numel() * t.element_size() if not t.is_meta else 0

    # -- step boundaries ---------------------------------------------------------------------
    def _begin_step(self, ids: torch.Tensor | None) -> None:
        self.step += 1
        self._in_step = True
        self._step_t0 = time.time()
        self._step_first_call = self._next_call
        self._step_ids = ids.detach() if ids is not None and not ids.is_meta else None
        # inference tensors keep no version counter: in-place detection is off there
        self._track_versions = not torch.is_inference_mode_enabled()
        self._logits = None
        self._partial = []

    def _end_step(self, complete: bool) -> None:
        if not self._in_step:
            return
        try:
            self._reduce_pending(final=True, complete=complete)
        finally:
            self._in_step = False
            self._root_depth = 0
            self._pending.clear()
            self._partial = []
            self._logits = None
            self._step_ids = None

    # -- batched reduction -------------------------------------------------------------------
    def _reduce_pending(self, final: bool = False, complete: bool = True) -> None:
        """Reduce every pending tensor in a few batched ops per (shape, dtype, device) group.

        Fast pass (_fast_group): sums, sums of squares, per-channel and per-token min/max, all
        NaN-propagating, so a record whose stats come back finite provably had no NaN/Inf. Only records whose stats are
        not finite get the exact, finite-only pass (a second batched reduction and transfer,
        in failing steps only)."""
        p = self._pending
        meta, tensors, versions = p.meta, p.tensors, p.versions
        p.clear()
        n = len(tensors)
        want_channels = self._channel_step(self.step)
        chan_io = self.options["channel_io"]
        chan_limit = self.options["channel_limit"]

        # one pass over the tensors: unique tensors (q/k/v and gate/up share one input, a block's
        # input is the previous block's output) and their (shape, dtype, device) groups
        uniq: dict[int, int] = {}
        order: list[torch.Tensor] = []
        which_l: list[int] = []
        groups: dict[Any, list[int]] = {}
        for t in tensors:
            k = id(t)
            j = uniq.get(k)
            if j is None:
                j = uniq[k] = len(order)
                order.append(t)
                key = (t.shape, t.dtype, t.device)
                g = groups.get(key)
                if g is None:
                    groups[key] = [j]
                else:
                    g.append(j)
            which_l.append(j)
        which = np.array(which_l, dtype=np.int64)
        n_u = len(order)
        meta_arr = np.array(meta, dtype=np.int64).reshape(n, 4)
        need = np.zeros(n_u, bool)
        if chan_io == "all":
            need[:] = True
        elif chan_io == "inputs":
            need[which[meta_arr[:, 2] == schema.IO_INPUT]] = True

        st = _UniqueStats(n_u, need)
        plan = []
        per_dev: dict[torch.device, list[torch.Tensor]] = {}
        for (shape, dtype, device), idx_l in groups.items():
            idx = np.array(idx_l, dtype=np.int64)
            chans = int(shape[-1]) if len(shape) else 1
            numel = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
            rows = numel // max(chans, 1)
            st.describe(idx, chans, numel, dtype, device.type == "meta")
            if device.type == "meta" or numel == 0:
                continue
            keep = want_channels and chans <= chan_limit and bool(need[idx].any())
            packed = _fast_group([order[j] for j in idx_l], rows, chans, keep)
            per_dev.setdefault(packed.device, []).append(packed)
            plan.append((idx, rows, chans, keep, packed.device, packed.numel()))
        logit_dev = ids_dev = None
        if final and self._logits is not None:
            lp = _fast_logits(self._logits)
            logit_dev = lp.device
            per_dev.setdefault(lp.device, []).append(lp)
        n_ids = 0
        if final and self._step_ids is not None and self._step_ids.numel():
            ids_t = self._step_ids.reshape(-1)[:65536].to(torch.float32)  # exact < 2**24
            n_ids = ids_t.numel()
            ids_dev = ids_t.device
            per_dev.setdefault(ids_dev, []).append(ids_t)
        # ONE device->host transfer per device
        host = {dev: torch.cat(parts).cpu().numpy() for dev, parts in per_dev.items()}
        cursor = {dev: 0 for dev in host}

        st.unpack(plan, host, cursor)
        logits_row = None
        ids_host = np.zeros(0, np.int64)
        if logit_dev is not None:
            c = cursor[logit_dev]
            logits_row = _logits_row(host[logit_dev][c:c + 15], self._logits)
            cursor[logit_dev] = c + 15
        if ids_dev is not None:
            c = cursor[ids_dev]
            ids_host = host[ids_dev][c:c + n_ids].astype(np.int64)
            cursor[ids_dev] = c + n_ids

        bad = np.nonzero(st.computed & ~np.isfinite(st.sc).all(axis=1))[0]
        if len(bad):  # failing step: exact finite-only stats for the records that need them
            st.exact_pass(bad, order, want_channels, chan_limit)

        part = self._assemble(meta_arr, tensors, versions, which, st, chan_io)
        self._maybe_snapshot(part, meta, tensors)
        self._partial.append(part)
        if final:
            self._emit(logits_row, ids_host, complete)

    @staticmethod
    def _exact_logits(logits: torch.Tensor) -> torch.Tensor:
        """18 numbers: min max mean std entropy nan inf argmax top5 ids (5) top5 values (5)."""
        with torch.no_grad():
            v = _last_logits(logits).to(torch.float32)
            fin = torch.isfinite(v)
            nan = torch.isnan(v).sum()
            inf = (~fin).sum() - nan
            vz = torch.where(fin, v, float("-inf"))
            big = torch.finfo(torch.float32).max
            vmin = torch.where(fin, v, big).min()
            vmax = torch.where(fin, v, -big).max()
            cnt = fin.sum().clamp_min(1)
            mean = torch.where(fin, v, 0.0).sum() / cnt
            std = (torch.where(fin, v - mean, 0.0).pow(2).sum() / cnt).sqrt()
            logp = torch.log_softmax(vz, 0)
            ent = -(torch.where(fin, logp.exp() * logp, 0.0)).sum()
            k = min(5, v.numel())
            # topk over NaN-free values; a NaN logit ranks first in plain topk
            top = torch.topk(torch.where(torch.isnan(v), float("-inf"), v), k)
            ids = torch.full((5,), -1.0, dtype=torch.float32, device=v.device)
            vals = torch.full((5,), float("nan"), dtype=torch.float32, device=v.device)
            ids[:k] = top.indices.float()
            vals[:k] = top.values
            arg = torch.where(nan > 0, torch.tensor(-1.0, device=v.device),
                              top.indices[0].float())
            return torch.cat([torch.stack([vmin, vmax, mean, std, ent, nan.float(), inf.float(),
                                           arg]), ids, vals])

    # -- host side assembly ------------------------------------------------------------------
    def _assemble(self, meta_arr: np.ndarray, tensors: list, versions: list, which: np.ndarray,
                  st: "_UniqueStats", chan_io: str) -> dict[str, Any]:
        n = len(meta_arr)
        rec = np.zeros(n, dtype=schema.record_dtype())
        rec["call_index"] = meta_arr[:, 0]
        rec["step"] = self.step
        rec["module_id"] = meta_arr[:, 1]
        rec["io"] = meta_arr[:, 2]
        rec["slot"] = meta_arr[:, 3]
        rec["dtype"] = st.dtype_code[which]
        flags = st.flags[which].copy()
        if self._track_versions:
            now = np.fromiter((t._version for t in tensors), np.int64, n)
            flags |= np.where(now != np.asarray(versions, np.int64), schema.FLAG_MUTATED, 0)
        rec["flags"] = flags
        rec["numel"] = st.numel[which]
        rec["rows"] = st.rows[which]
        rec["channels"] = st.chans[which]
        for k, f in enumerate(("min", "max", "mean", "std", "absmax")):
            rec[f] = st.sc[which, k]
        rec["nan_count"] = st.nan[which]
        rec["inf_count"] = st.inf[which]
        coff = st.chan_off[which]
        if chan_io == "inputs":
            coff = np.where(meta_arr[:, 2] == schema.IO_INPUT, coff, -1)
        rec["chan_offset"] = coff
        rec["tok_offset"] = st.tok_off[which]
        rec["tok_count"] = st.tok_cnt[which]
        return {"records": rec, "cmin": st.cmin(), "cmax": st.cmax(), "tok": st.tok()}

    def _emit(self, logits_row: np.ndarray | None, ids: np.ndarray, complete: bool) -> None:
        parts = self._partial
        recs = []
        cmins, cmaxs, toks = [], [], []
        chan_base = tok_base = 0
        for part in parts:
            rec = part["records"]
            rec["chan_offset"] = np.where(rec["chan_offset"] >= 0, rec["chan_offset"] + chan_base, -1)
            rec["tok_offset"] = np.where(rec["tok_offset"] >= 0, rec["tok_offset"] + tok_base, -1)
            chan_base += len(part["cmin"])
            tok_base += len(part["tok"])
            recs.append(rec)
            cmins.append(part["cmin"])
            cmaxs.append(part["cmax"])
            toks.append(part["tok"])
        rec = np.concatenate(recs) if recs else np.zeros(0, schema.record_dtype())
        order = np.argsort(rec["call_index"], kind="stable")
        rec = rec[order]
        st = np.zeros(1, dtype=schema.step_dtype())
        s = st[0]
        s["step"] = self.step
        s["t_start"] = self._step_t0
        s["duration"] = time.time() - self._step_t0
        s["complete"] = 1 if complete else 0
        s["record_offset"] = 0
        s["record_count"] = len(rec)
        s["first_call"] = self._step_first_call if self._next_call > self._step_first_call else -1
        s["n_calls"] = self._next_call - self._step_first_call
        bad = (rec["nan_count"] + rec["inf_count"]) > 0
        s["n_nonfinite_records"] = int(bad.sum())
        s["first_nonfinite_record"] = int(np.argmax(bad)) if bad.any() else -1
        out_bad = bad & (rec["io"] == schema.IO_OUTPUT)
        s["first_nonfinite_call"] = int(rec["call_index"][np.argmax(out_bad)]) if out_bad.any() else -1
        s["token_offset"] = 0
        s["token_count"] = len(ids)
        if logits_row is not None:
            s["has_logits"] = 1
            if not logits_row[0] <= logits_row[1]:  # no finite logit at all
                logits_row = logits_row.copy()
                logits_row[[0, 1, 2, 3, 4]] = np.nan
            (s["logits_min"], s["logits_max"], s["logits_mean"], s["logits_std"],
             s["logits_entropy"]) = logits_row[:5]
            s["logits_nan"], s["logits_inf"], s["logits_argmax"] = (
                int(logits_row[5]), int(logits_row[6]), int(logits_row[7]))
            s["logits_top5_ids"] = logits_row[8:13].astype(np.int64)
            s["logits_top5_values"] = logits_row[13:18]
        else:
            s["logits_argmax"] = -1
            s["logits_top5_ids"] = -1
            for f in ("logits_min", "logits_max", "logits_mean", "logits_std", "logits_entropy"):
                s[f] = np.nan
            s["logits_top5_values"] = np.nan
        snaps = (np.concatenate(self._snap_rows) if self._snap_rows
                 else np.zeros(0, schema.snapshot_dtype()))
        data = np.concatenate(self._snap_data) if self._snap_data else np.zeros(0, np.uint8)
        self._snap_rows, self._snap_data = [], []
        incidents = (np.concatenate(self._incidents) if self._incidents
                     else np.zeros(0, schema.incident_dtype()))
        self._incidents = []
        batch = StepBatch(
            steps=st, records=rec,
            chan_min=np.concatenate(cmins) if cmins else np.zeros(0),
            chan_max=np.concatenate(cmaxs) if cmaxs else np.zeros(0),
            tok_absmax=np.concatenate(toks) if toks else np.zeros(0, np.float32),
            input_ids=ids, snapshots=snaps, snapshot_bytes=data, incidents=incidents,
        )
        if self.options["channel_dtype"] == "float16":
            batch.chan_min = _to_f16(batch.chan_min)
            batch.chan_max = _to_f16(batch.chan_max)
        assert self._writer is not None
        self._writer.submit(batch)

    # -- snapshots ---------------------------------------------------------------------------
    def _maybe_snapshot(self, part: dict[str, Any], meta: list, tensors: list) -> None:
        rec = part["records"]
        if len(rec) == 0 or len(self._snapped) == len(schema.SNAPSHOT_REASONS):
            return
        if "first_nonfinite_output" not in self._snapped:
            bad = (rec["io"] == schema.IO_OUTPUT) & ((rec["nan_count"] + rec["inf_count"]) > 0)
            if bad.any():
                i = int(np.argmax(bad))
                self._snapped.add("first_nonfinite_output")
                self._snapshot_call("first_nonfinite_output", int(rec["call_index"][i]),
                                    int(rec["module_id"][i]), meta, tensors)
        if "first_outlier" not in self._snapped:
            gemm = np.isin(rec["module_id"], self._gemm_ids)
            hot = gemm & (rec["io"] == schema.IO_INPUT) & (
                rec["absmax"] >= self.options["outlier_threshold"]) & (
                (rec["flags"] & schema.FLAG_NONFLOAT) == 0)
            if hot.any():
                i = int(np.argmax(hot))
                self._snapped.add("first_outlier")
                ci = int(rec["call_index"][i])
                same = [r for r in self._snap_rows if int(r["call_index"][0]) == ci]
                if same:  # the same call was just kept for its NaN: point at those bytes
                    for r in same:
                        dup = r.copy()
                        dup["reason"] = b"first_outlier"
                        self._snap_rows.append(dup)
                else:
                    self._snapshot_call("first_outlier", ci, int(rec["module_id"][i]), meta,
                                        tensors)

    def _snapshot_call(self, reason: str, ci: int, mid: int, meta: list, tensors: list) -> None:
        try:
            items: list[tuple[str, torch.Tensor]] = []
            out = None
            for (c, m, io, slot), t in zip(meta, tensors):
                if c == ci:
                    items.append((f"{'input' if io == 0 else 'output'}.{slot}", t))
                    if io == 1 and slot == 0:
                        out = t
            module = self._modules[mid] if 0 <= mid < len(self._modules) else None
            r0 = 0
            if out is not None and out.is_floating_point() and not out.is_meta:
                pos = torch.nonzero(~torch.isfinite(out))[:_MAX_NONFINITE_POSITIONS]
                if len(pos):
                    items.append(("nonfinite_positions", pos))
                    r0 = int(pos[0, -1])
            if module is not None and self._kinds[mid] in ("linear", "quantized_linear"):
                items += self._weight_tile(module, r0)
            for name, t in items:
                self._keep(reason, ci, mid, name, t)
        except Exception as exc:
            log.warning("qforensics: snapshot of call %d failed (%s); continuing", ci, exc)

    def _weight_tile(self, module: nn.Module, col: int) -> list[tuple[str, torch.Tensor]]:
        """Weights covering a tile of output columns around `col` (dense or AWQ/GPTQ packed)."""
        tile = max(8, self.options["snapshot_tile_rows"])
        out: list[tuple[str, torch.Tensor]] = []
        w = getattr(module, "weight", None)
        qw = getattr(module, "qweight", None)
        if isinstance(qw, torch.Tensor):
            n_out = qw.shape[1] * 8
            c0 = (col // tile) * tile
            c1 = min(n_out, c0 + tile)
            out.append(("qweight", qw[:, c0 // 8:(c1 + 7) // 8]))
            for name in ("qzeros",):
                t = getattr(module, name, None)
                if isinstance(t, torch.Tensor):
                    out.append((name, t[:, c0 // 8:(c1 + 7) // 8]))
            sc = getattr(module, "scales", None)
            if isinstance(sc, torch.Tensor):
                out.append(("scales", sc[:, c0:c1]))
            g = getattr(module, "g_idx", None)
            if isinstance(g, torch.Tensor):
                out.append(("g_idx", g))
            out.append(("weight_cols", torch.tensor([c0, c1, n_out])))
        elif isinstance(w, torch.Tensor) and w.dim() == 2 and not w.is_meta:
            n_out = w.shape[0]
            r0 = (col // tile) * tile if col < n_out else 0
            r1 = min(n_out, r0 + tile)
            out.append(("weight", w[r0:r1]))
            out.append(("weight_rows", torch.tensor([r0, r1, n_out])))
        b = getattr(module, "bias", None)
        if isinstance(b, torch.Tensor):
            out.append(("bias", b))
        return out

    def _keep(self, reason: str, ci: int, mid: int, name: str, t: torch.Tensor) -> None:
        t = t.detach()
        if t.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
            t = t.to(torch.float32)
        arr = t.cpu().contiguous().numpy()
        arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
        budget = self.options["snapshot_budget"] - self._snap_bytes
        truncated = 0
        if arr.nbytes > budget:
            if arr.ndim == 0 or budget <= 0:
                return
            per_row = max(1, arr.nbytes // max(arr.shape[0], 1))
            keep = budget // per_row
            if keep <= 0:
                return
            arr = arr[:keep]
            truncated = 1
        row = np.zeros(1, schema.snapshot_dtype())
        row["call_index"], row["step"], row["module_id"] = ci, self.step, mid
        row["reason"], row["name"] = reason.encode(), name.encode()
        row["dtype"] = arr.dtype.name.encode()
        row["shape"] = json.dumps(list(arr.shape)).encode()
        row["offset"] = sum(len(d) for d in self._snap_data)
        row["nbytes"] = arr.nbytes
        row["truncated"] = truncated
        self._snap_rows.append(row)
        self._snap_data.append(np.frombuffer(np.ascontiguousarray(arr).tobytes(), np.uint8))
        self._snap_bytes += arr.nbytes

    # -- incidents (runtime guard) ---------------------------------------------------------
    def record_incident(self, module: str, action: str, *, nan_count: int = 0,
                        inf_count: int = 0, detail: str = "", call_index: int = -1) -> None:
        """Note a runtime-guard trip; it is written with the current (or next) step."""
        try:
            row = np.zeros(1, schema.incident_dtype())
            row["step"] = max(self.step, 0)
            row["call_index"] = call_index
            try:
                row["module_id"] = self._names.index(module)
            except ValueError:
                row["module_id"] = -1
            row["module"] = module.encode("utf-8", "replace")[:128]
            row["action"] = action.encode()[:24]
            row["nan_count"], row["inf_count"] = nan_count, inf_count
            row["detail"] = detail.encode("utf-8", "replace")[:160]
            self._incidents.append(row)
        except Exception as exc:
            log.warning("qforensics: could not record an incident (%s)", exc)

    # -- failure handling and teardown -------------------------------------------------------
    def _degrade(self, exc: BaseException) -> None:
        if self._degraded is None:
            self._degraded = f"{type(exc).__name__}: {exc}"
            log.error("qforensics: capture error (%s); recording stops, the run continues",
                      self._degraded, exc_info=True)
        self._pending.clear()

    @property
    def degraded(self) -> str | None:
        w = self._writer.failed if self._writer is not None else None
        return self._degraded or w

    def _remove_hooks(self) -> None:
        for h in self._handles:
            try:
                h.remove()
            except Exception:
                pass
        self._handles = []

    def close(self, status: dict[str, Any] | None = None) -> None:
        """Finish the open step, remove every hook, flush and seal the trace (idempotent)."""
        with self._lock:
            if not self._attached:
                return
            self._attached = False
            try:
                if self._in_step and not self._degraded:
                    try:
                        self._end_step(complete=status is None or status.get("state") == "complete")
                    except Exception as exc:
                        self._degrade(exc)
                if self._incidents and self._writer is not None:  # trips after the last step
                    self._writer.submit(StepBatch(
                        steps=np.zeros(0, schema.step_dtype()),
                        records=np.zeros(0, schema.record_dtype()), chan_min=np.zeros(0),
                        chan_max=np.zeros(0), tok_absmax=np.zeros(0, np.float32),
                        input_ids=np.zeros(0, np.int64),
                        incidents=np.concatenate(self._incidents)))
                    self._incidents = []
            finally:
                self._remove_hooks()
                with _ACTIVE_LOCK:
                    _ACTIVE.pop(id(self.model), None)
                st = dict(status or {"state": "complete"})
                st["steps"] = self.step + 1
                st["calls"] = self._next_call
                if self._degraded:
                    st["capture_error"] = self._degraded
                if self._writer is not None:
                    self._writer.close(st)
                _unregister_exit(self)

    @property
    def hooks_attached(self) -> int:
        return len(self._handles)


def _fast_group(ts: list[torch.Tensor], rows: int, chans: int, keep_ch: bool) -> torch.Tensor:
    """g same-shaped tensors -> one float32 vector: sum (g), sum of squares (g), then per-channel
    min (g*C) and max (g*C) when kept, else the tensor min (g) and max (g), then per-token absmax
    (g*R). NaN/Inf propagate. The host derives min/max/absmax/mean/std from these.

    Only plain reductions (sum, amin, amax): on CPU builds var_mean, aminmax and vector_norm are
    3-4x slower for these shapes. Single-token tensors (decoding) skip the per-channel pass: their
    channel ranges are the values themselves."""
    with torch.no_grad():
        x = torch.stack(ts) if len(ts) > 1 else ts[0].unsqueeze(0)
        g = x.shape[0]
        if x.dtype not in (torch.float32, torch.float64):
            x = x.to(torch.float32)
        if rows == 1:
            x2 = x.reshape(g, chans)
            parts = [x2.sum(1), (x2 * x2).sum(1), x2.amin(1), x2.amax(1)]
            if keep_ch:
                parts.append(x2.reshape(-1))
        else:
            x = x.reshape(g, rows, chans)
            cmin, cmax = x.amin(1), x.amax(1)
            tok = torch.maximum(x.amax(2), -x.amin(2))
            parts = [x.sum((1, 2)), (x * x).sum((1, 2))]
            parts += ([cmin.reshape(-1), cmax.reshape(-1)] if keep_ch
                      else [cmin.amin(1), cmax.amax(1)])
            parts.append(tok.reshape(-1))
        out = torch.cat(parts)
        return out if out.dtype == torch.float32 else out.to(torch.float32)


def _exact_group(ts: list[torch.Tensor], rows: int, chans: int, keep_ch: bool) -> torch.Tensor:
    """Like _fast_group but over finite values only, plus NaN and Inf counts:
    [min, max, mean, std, absmax, nan, inf] x g, chan min, chan max (kept), token absmax."""
    with torch.no_grad():
        x = torch.stack(ts) if len(ts) > 1 else ts[0].unsqueeze(0)
        g = x.shape[0]
        x = x.reshape(g, rows, chans).to(torch.float64)
        fin = torch.isfinite(x)
        nan = torch.isnan(x).sum((1, 2))
        inf = (~fin).sum((1, 2)) - nan
        xz = torch.where(fin, x, 0.0)
        cnt = fin.sum((1, 2)).clamp_min(1)
        mean = xz.sum((1, 2)) / cnt
        dev = torch.where(fin, x - mean.view(g, 1, 1), 0.0)
        std = ((dev * dev).sum((1, 2)) / cnt).sqrt()
        big = torch.finfo(torch.float64).max
        cmin = torch.where(fin, x, big).amin(1)
        cmax = torch.where(fin, x, -big).amax(1)
        empty = ~fin.any(1)
        cmin = torch.where(empty, float("nan"), cmin)
        cmax = torch.where(empty, float("nan"), cmax)
        vmin = torch.where(fin, x, big).amin((1, 2))
        vmax = torch.where(fin, x, -big).amax((1, 2))
        absmax = torch.maximum(vmin.abs(), vmax.abs())
        tok = xz.abs().amax(2)
        parts = [torch.stack([vmin, vmax, mean, std, absmax, nan.double(), inf.double()]
                             ).reshape(-1)]
        if keep_ch:
            parts += [cmin.reshape(-1), cmax.reshape(-1)]
        parts.append(tok.reshape(-1))
        return torch.cat(parts)


class _UniqueStats:
    """Host-side stats of the unique tensors of one reduction, filled group by group."""

    def __init__(self, n_u: int, need: np.ndarray) -> None:
        self.need = need
        self.sc = np.full((n_u, 5), np.nan)  # min max mean std absmax
        self.nan = np.zeros(n_u, np.int64)
        self.inf = np.zeros(n_u, np.int64)
        self.rows = np.zeros(n_u, np.int64)
        self.chans = np.zeros(n_u, np.int64)
        self.numel = np.zeros(n_u, np.int64)
        self.computed = np.zeros(n_u, bool)
        self.dtype_code = np.zeros(n_u, np.int8)
        self.flags = np.zeros(n_u, np.int8)
        self.chan_off = np.full(n_u, -1, np.int64)
        self.tok_off = np.full(n_u, -1, np.int64)
        self.tok_cnt = np.zeros(n_u, np.int64)
        self._cmin: list[np.ndarray] = []
        self._cmax: list[np.ndarray] = []
        self._tok: list[np.ndarray] = []
        self._chan_len = 0
        self._tok_len = 0

    def describe(self, idx: np.ndarray, chans: int, numel: int, dtype: torch.dtype,
                 meta: bool) -> None:
        self.chans[idx] = chans
        self.numel[idx] = numel
        self.dtype_code[idx] = _dtype_code(dtype)
        self.flags[idx] = (schema.FLAG_META if meta else 0) | (
            0 if dtype.is_floating_point else schema.FLAG_NONFLOAT)

    def unpack(self, plan: list, host: dict, cursor: dict) -> None:
        """Fast-pass results (layout of _fast_group) into the arrays."""
        for idx, rows, chans, keep, dev, size in plan:
            c = cursor[dev]
            flat = host[dev][c:c + size]  # float32: channel and token values stay float32
            cursor[dev] = c + size
            g = len(idx)
            n_el = float(rows * chans)
            mean = flat[:g].astype(np.float64) / n_el
            with np.errstate(invalid="ignore", over="ignore"):
                var = np.maximum(flat[g:2 * g].astype(np.float64) / n_el - mean * mean, 0.0)
            off = 2 * g
            with np.errstate(invalid="ignore"):
                if rows == 1:  # see _fast_group: min, max, then the values when kept
                    vmin = flat[off:off + g].astype(np.float64)
                    vmax = flat[off + g:off + 2 * g].astype(np.float64)
                    off += 2 * g
                    absmax = np.maximum(np.abs(vmin), np.abs(vmax))
                    if keep:
                        vals = flat[off:off + g * chans].reshape(g, chans)
                        sel = self.need[idx]
                        if sel.any():
                            m = int(sel.sum())
                            self.chan_off[idx[sel]] = self._chan_len + np.arange(m) * chans
                            kept = vals[sel].reshape(-1)
                            self._cmin.append(kept)
                            self._cmax.append(kept.copy())
                            self._chan_len += m * chans
                    self.sc[idx] = np.stack([vmin, vmax, mean, np.sqrt(var), absmax], axis=1)
                    self.rows[idx] = 1
                    self.computed[idx] = True
                    self.tok_off[idx] = self._tok_len + np.arange(g)
                    self.tok_cnt[idx] = 1
                    self._tok.append(absmax.astype(np.float32))
                    self._tok_len += g
                    continue
                if keep:
                    cmin = flat[off:off + g * chans].reshape(g, chans)
                    cmax = flat[off + g * chans:off + 2 * g * chans].reshape(g, chans)
                    off += 2 * g * chans
                    vmin = cmin.min(axis=1).astype(np.float64)
                    vmax = cmax.max(axis=1).astype(np.float64)
                    sel = self.need[idx]
                    if sel.any():
                        m = int(sel.sum())
                        self.chan_off[idx[sel]] = self._chan_len + np.arange(m) * chans
                        self._cmin.append(cmin[sel].reshape(-1))
                        self._cmax.append(cmax[sel].reshape(-1))
                        self._chan_len += m * chans
                else:
                    vmin = flat[off:off + g].astype(np.float64)
                    vmax = flat[off + g:off + 2 * g].astype(np.float64)
                    off += 2 * g
                self.sc[idx] = np.stack([vmin, vmax, mean, np.sqrt(var),
                                         np.maximum(np.abs(vmin), np.abs(vmax))], axis=1)
            self.rows[idx] = rows
            self.computed[idx] = True
            self.tok_off[idx] = self._tok_len + np.arange(g) * rows
            self.tok_cnt[idx] = rows
            self._tok.append(flat[off:off + g * rows])
            self._tok_len += g * rows

    def exact_pass(self, bad: np.ndarray, order: list[torch.Tensor], want_channels: bool,
                   chan_limit: int) -> None:
        """Finite-only stats and exact NaN/Inf counts for the tensors the fast pass flagged;
        overwrites their scalars, channel ranges and token maxima (one more transfer)."""
        groups: dict[Any, list[int]] = {}
        for j in bad:
            t = order[int(j)]
            groups.setdefault((t.shape, t.dtype, t.device), []).append(int(j))
        plan = []
        per_dev: dict[torch.device, list[torch.Tensor]] = {}
        for _, idx in groups.items():
            t0 = order[idx[0]]
            chans = int(t0.shape[-1]) if t0.dim() else 1
            rows = t0.numel() // max(chans, 1)
            keep = want_channels and chans <= chan_limit
            packed = _exact_group([order[j] for j in idx], rows, chans, keep)
            per_dev.setdefault(packed.device, []).append(packed)
            plan.append((np.array(idx), rows, chans, keep, packed.device, packed.numel()))
        host = {dev: torch.cat(parts).cpu().numpy() for dev, parts in per_dev.items()}
        cursor = {dev: 0 for dev in host}
        cmin_all = self.cmin()
        cmax_all = self.cmax()
        tok_all = self.tok()
        for idx, rows, chans, keep, dev, size in plan:
            c = cursor[dev]
            flat = host[dev][c:c + size]
            cursor[dev] = c + size
            g = len(idx)
            sc = flat[:7 * g].reshape(7, g)
            off = 7 * g
            self.sc[idx] = sc[:5].T
            self.nan[idx] = sc[5]
            self.inf[idx] = sc[6]
            if keep:
                cmin = flat[off:off + g * chans].reshape(g, chans)
                cmax = flat[off + g * chans:off + 2 * g * chans].reshape(g, chans)
                off += 2 * g * chans
                for k, j in enumerate(idx):
                    o = self.chan_off[j]
                    if o >= 0:
                        cmin_all[o:o + chans] = cmin[k]
                        cmax_all[o:o + chans] = cmax[k]
            tok = flat[off:off + g * rows].reshape(g, rows)
            for k, j in enumerate(idx):
                o = self.tok_off[j]
                tok_all[o:o + rows] = tok[k]
        self._cmin, self._cmax, self._tok = [cmin_all], [cmax_all], [tok_all]
        # finite-only min/max of a tensor with no finite value: NaN (not +-max)
        big = np.finfo(np.float64).max
        empty = self.sc[bad, 0] >= big
        self.sc[bad[empty]] = np.nan

    def cmin(self) -> np.ndarray:
        return np.concatenate(self._cmin) if self._cmin else np.zeros(0)

    def cmax(self) -> np.ndarray:
        return np.concatenate(self._cmax) if self._cmax else np.zeros(0)

    def tok(self) -> np.ndarray:
        return np.concatenate(self._tok) if self._tok else np.zeros(0, np.float32)


def _fast_logits(logits: torch.Tensor) -> torch.Tensor:
    """15 float32: min max mean var entropy, top-5 values, top-5 ids (last position of batch
    row 0). NaN/Inf propagate; _logits_row redoes it exactly when they do."""
    with torch.no_grad():
        v = _last_logits(logits).to(torch.float32)
        mn, mx = v.amin(), v.amax()
        mean = v.mean()
        var = (v * v).mean() - mean * mean
        logp = torch.log_softmax(v, 0)
        ent = -(logp.exp() * logp).sum()
        top = torch.topk(v, min(5, v.numel()))
        vals = torch.full((5,), float("nan"), device=v.device)
        ids = torch.full((5,), -1.0, device=v.device)
        vals[:top.values.numel()] = top.values
        ids[:top.indices.numel()] = top.indices.float()
        return torch.cat([torch.stack([mn, mx, mean, var, ent]), vals, ids])


def _last_logits(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() == 3:
        return logits[0, -1]
    if logits.dim() > 1:
        return logits.reshape(-1, logits.shape[-1])[-1]
    return logits.reshape(-1)


def _logits_row(fast: np.ndarray, logits: torch.Tensor) -> np.ndarray:
    """The 18-number logits row (min max mean std entropy nan inf argmax, top-5 ids, top-5
    values); from the fast pass when everything was finite, else from the exact pass."""
    f = fast.astype(np.float64)
    if np.isfinite(f[:5]).all():
        return np.concatenate([[f[0], f[1], f[2], np.sqrt(max(f[3], 0.0)), f[4], 0, 0, f[10]],
                               f[10:15], f[5:10]])
    return Capture._exact_logits(logits).cpu().numpy().astype(np.float64)


def active_capture(model: nn.Module) -> Capture | None:
    """The capture attached to `model`, if any (the guard reports its trips there)."""
    with _ACTIVE_LOCK:
        return _ACTIVE.get(id(model))


def _to_f16(a: np.ndarray) -> np.ndarray:
    """float16 without turning large finite values into inf (clip finite values to 65504)."""
    lim = np.float64(65504.0)
    a = np.asarray(a, np.float64)
    return np.where(np.isfinite(a), np.clip(a, -lim, lim), a).astype(np.float16)


# -- process exit / signals: flush what we have --------------------------------------------------
_OPEN: "weakref.WeakSet[Capture]" = weakref.WeakSet()
_SIG_INSTALLED = False


def _register_exit(cap: Capture) -> None:
    global _SIG_INSTALLED
    _OPEN.add(cap)
    if not _SIG_INSTALLED and threading.current_thread() is threading.main_thread():
        _SIG_INSTALLED = True
        atexit.register(_close_all, "exit")
        for sig in (signal.SIGTERM,):
            prev = signal.getsignal(sig)
            if prev in (signal.SIG_IGN,):
                continue
            signal.signal(sig, partial(_on_signal, prev))


def _unregister_exit(cap: Capture) -> None:
    _OPEN.discard(cap)


def _close_all(reason: str) -> None:
    status = ({"state": "complete", "closed_by": "interpreter exit"} if reason == "exit"
              else {"state": reason})
    for cap in list(_OPEN):
        try:
            cap.close(status)
        except Exception:
            pass


def _on_signal(prev: Any, signum: int, frame: Any) -> None:
    _close_all(f"signal {signal.Signals(signum).name}")
    if callable(prev):
        prev(signum, frame)
    else:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def capture(model: nn.Module, path: str | os.PathLike[str] = "trace.h5", **options: Any
            ) -> Capture:
    """Capture per-call statistics of `model` into an HDF5 trace at `path`.

    >>> with qforensics.capture(model, "trace.h5"):       # doctest: +SKIP
    ...     model.generate(input_ids, max_new_tokens=64)

    Options: modules (None | "linear" | names | callable), flush_interval (s, default 1),
    channel_dtype ("float32" | "float16"), channel_limit (widest last dim whose per-channel
    ranges are stored, default 8192), channel_steps ("all" | "none" | "0-3,8" | callable),
    channel_io ("all" | "inputs" | "none"), snapshot_budget (bytes, default 64 MiB),
    snapshot_tile_rows (weight rows kept around the first bad output, default 256),
    outlier_threshold (absmax that triggers the outlier snapshot, default 448), pending_budget
    (bytes held before an early reduction, default 256 MiB), metadata (dict recorded in the
    environment), rank / world_size (default from RANK / WORLD_SIZE). A path with "{rank}", or
    any path when world_size > 1, gives one file per rank.
    """
    return Capture(model, path, **options)
