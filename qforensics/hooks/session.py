"""`qforensics.capture(model, "trace.h5")`: forward hooks that stream per-call statistics into an
HDF5 trace.

How it stays fast and right: every hooked module's hook hands its tensors to one op, the stats
op (hooks/statsop.py), which reduces them where they are, as the hook saw them, into a ring of
static buffers on their device (hooks/graphstats.py); torch.compile traces the same hooks into
a compiled model's graph (hooks/graphhooks.py, hooks/graphmode.py). No host sync in a step: the
host reads a step's slot of the ring after it, builds its records off the hot path
(hooks/graphlate.py, on a GPU in a drainer thread) and the flight recorder (hooks/recorder.py)
decides which steps keep their per-channel ranges.

Hooks are global state: `capture` attaches in `__enter__`, removes every handle in `finally`,
refuses to attach twice to the same model and never writes attributes onto the user's modules
(names are bound with functools.partial). Nothing here may crash the host run: an internal error
is logged once and capture degrades (stops recording) while the run goes on.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from functools import partial
from typing import Any, Callable, Iterable

import numpy as np
import torch
from torch import nn

from qforensics.errors import CaptureError
from qforensics.trace.budgetopts import DEFAULT_MAX_BYTES
from qforensics.formats import E4M3_MAX, GEMM_KINDS
from qforensics.hooks import fused, registry
from qforensics.hooks.adapter import AdapterCalls, EngineAdapter
from qforensics.hooks.callhooks import MAX_INPUTS, MAX_OUTPUTS, CallHooks
from qforensics.hooks.graphmode import GraphMode, is_compiled
from qforensics.hooks.environment import describe_environment, rank_and_world
from qforensics.hooks.modules import ModuleFilter, describe_module, ring_chunk, select_modules
from qforensics.hooks.paramwatch import DEFAULT_EVERY, ParamWatch, watched_tensors
from qforensics.hooks.recorder import FlightRecorder, parse_steps
from qforensics.hooks.snapshots import Snapshots
from qforensics.hooks.stepend import StepEnd
from qforensics.incidents import register_sink
from qforensics.trace import schema
from qforensics.trace.writer import StepBatch, TraceWriter

log = logging.getLogger("qforensics.hooks.capture")


class Capture(CallHooks, StepEnd, GraphMode, AdapterCalls):
    """A capture session on one model. Create with `qforensics.capture(...)`; an engine passes
    its `adapter` (hooks/adapter.py)."""

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
        outlier_threshold: float = E4M3_MAX,
        ring_steps: int = 16,
        trigger_window: int = 8,
        trigger_limit: int = 32,
        outlier_growth: float = 4.0,
        max_bytes: int | None = DEFAULT_MAX_BYTES,
        metadata: dict[str, Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        compiled: bool | None = None,
        adapter: EngineAdapter | None = None,
        param_watch: int = DEFAULT_EVERY,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise CaptureError(f"capture needs a torch.nn.Module, got {type(model).__name__}")
        if compiled not in (None, True, False):
            raise CaptureError("compiled must be True, False or None (None: compiled when "
                               "torch.compile wraps the model)")
        compiled_wrapper = type(model).__name__ == "OptimizedModule"
        if compiled_wrapper:  # torch.compile(model): hook the model
            model = model._orig_mod  # type: ignore[assignment]
            compiled = True if compiled is None else compiled
        if flush_interval <= 0:
            raise CaptureError("flush_interval must be positive (seconds)")
        if ring_steps < 1 or not 0 <= trigger_window <= ring_steps:
            raise CaptureError("ring_steps must be >= 1 and 0 <= trigger_window <= ring_steps")
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(
                max_bytes, (int, np.integer)) or max_bytes < 0):
            raise CaptureError(f"max_bytes must be a byte count >= 0 (0 or None: no cap), "
                               f"got {max_bytes!r}")
        if isinstance(param_watch, bool) or not isinstance(param_watch, (int, np.integer)) \
                or param_watch < 0:
            raise CaptureError(f"param_watch must be a step count >= 0 (0: parameters checked "
                               f"at attach only), got {param_watch!r}")
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
            "channel_steps": (channel_steps or "auto") if isinstance(channel_steps, str)
            or channel_steps is None else "custom",
            "ring_steps": int(ring_steps),
            "trigger_window": int(trigger_window),
            "trigger_limit": int(trigger_limit),
            "outlier_growth": float(outlier_growth),
            "max_bytes": int(max_bytes) if max_bytes else 0,
            "channel_io": channel_io,
            "snapshot_budget": int(snapshot_budget),
            "snapshot_tile_rows": int(snapshot_tile_rows),
            "outlier_threshold": float(outlier_threshold),
            "modules": modules if isinstance(modules, str) or modules is None else "custom",
            "compiled": "auto" if compiled is None else bool(compiled),
            "param_watch": int(param_watch),
        }
        self.adapter = adapter if adapter is not None else EngineAdapter()
        engine_compiles = self.adapter.compiled()
        # the model runs eagerly (compiled=False; else no engine compile, no torch.compile): its
        # hooks may run a module more than once in a step (a guard's rerun), so the ring keeps
        # room for that
        self._eager_model = compiled is False or not (
            engine_compiles or compiled_wrapper or is_compiled(model))
        self._gs = None
        self._late: collections.deque = collections.deque()  # compiled steps not yet emitted
        self._drainer = None  # compiled mode's drainer thread (hooks/drainer.py)
        self._draining = False  # `_degrade` emitting the steps noted before the error
        self._graph_why: str | None = None
        self._graph_step = -1
        self._graph_first = 0
        self._unhooked: set[int] = set()  # ids of modules the adapter records (no hook)
        self._channel_step = parse_steps(channel_steps)
        self._metadata = dict(metadata or {})
        self._handles: list[Any] = []
        self._hook_path = "graph"
        self._writer: TraceWriter | None = None
        self._attached = False
        self._degraded: str | None = None
        self._lock = threading.RLock()
        self._step_lock = threading.RLock()  # serializes steps of concurrent forwards
        # the step boundaries, and the emission of waiting steps between them from another
        # thread (hooks/graphlate.py `_graph_linger`)
        self._emit_lock = threading.RLock()
        # run state
        self.step = -1
        self._in_step = False
        self._root_depth = 0
        self._next_call = 0
        self._step_first_call = 0
        self._step_t0 = 0.0
        self._step_ids: torch.Tensor | None = None
        self._logits: torch.Tensor | None = None
        self._keep_channels = False  # this step keeps its channel ranges (channel_steps)
        self._snaps: Snapshots | None = None
        self._recorder: FlightRecorder | None = None
        self._incidents: list[np.ndarray] = []
        self._watch: ParamWatch | None = None  # parameters rechecked during the run
        self._sink: Any = None  # registration in qforensics.incidents
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
        if not registry.claim(self.model, self):
            raise CaptureError(
                f"a capture is already attached to this {type(self.model).__name__}; "
                "close it before attaching another"
            )
        try:
            chosen = select_modules(self.model, self._module_spec)
            extra = self.adapter.extra_modules(self.model, chosen)
            if extra and chosen and chosen[-1][2] == "root":  # before the root, which is last
                chosen = chosen[:-1] + extra + chosen[-1:]
            self._unhooked = {id(m) for _, m, _ in extra}
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
                                       if k in GEMM_KINDS], np.int64)
            self._snaps = Snapshots(
                budget=self.options["snapshot_budget"],
                tile_rows=self.options["snapshot_tile_rows"],
                modules=self._modules, kinds=self._kinds)
            env = describe_environment(self.model, self.rank, self.world_size)
            env.update({k: v for k, v in self._metadata.items()})
            auto = self.options["channel_steps"] == "auto"
            self._recorder = FlightRecorder(
                slots=self.options["ring_steps"], window=self.options["trigger_window"],
                limit=self.options["trigger_limit"], growth=self.options["outlier_growth"],
                gemm_ids=self._gemm_ids) if auto else None
            self._writer = TraceWriter(
                self.path, modules=descr, environment=env, capture_options=self.options,
                channel_dtype=self.options["channel_dtype"],
                flush_interval=self.options["flush_interval"],
                ring_slots=self.options["ring_steps"] if auto else 0,
                max_bytes=self.options["max_bytes"],
                ring_chunk=ring_chunk(self._modules),
            )
            if self.options["param_watch"]:
                self._watch = ParamWatch(watched_tensors(chosen, self.model),
                                         self.options["param_watch"])
            root_id = len(chosen) - 1
            if not self._attach_graph(chosen, MAX_INPUTS, MAX_OUTPUTS) and self._graph_why:
                self._hook_path = "none"
            self.adapter.attach(self)
            self._attach_root(root_id)
        except BaseException:
            self._remove_hooks()
            self._graph_close()
            registry.release(self.model)
            if self._writer is not None:
                self._writer.close({"state": "error", "error": "attach failed"})
            raise

    def _attach_root(self, root_id: int) -> None:
        """The root's hooks, outside any compiled region (torch.compile of the whole model
        breaks the graph there, before and after the model's own code)."""
        pre: Any = torch._dynamo.disable(self._on_root_pre)
        post: Any = torch._dynamo.disable(partial(self._on_root_post, root_id))
        self._handles.append(self.model.register_forward_pre_hook(pre, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(post, with_kwargs=True,
                                                              always_call=True))
        self._attached = True
        self._sink = register_sink(self.model, self.record_incident)  # guard incidents
        registry.register_exit(self)

    # -- step boundaries ---------------------------------------------------------------------
    def _begin_step(self, ids: torch.Tensor | None) -> None:
        with self._emit_lock:
            self._begin_step_locked(ids)

    def _begin_step_locked(self, ids: torch.Tensor | None) -> None:
        self.step += 1
        self._in_step = True
        self._step_t0 = time.time()
        self._step_first_call = self._next_call
        self._step_ids = ids.detach() if ids is not None and not ids.is_meta else None
        self._keep_channels = (self._channel_step(self.step)
                               and self.options["channel_io"] != "none")
        self._logits = None
        self._graph_begin()

    def _end_step(self, complete: bool) -> None:
        with self._emit_lock:
            self._end_step_locked(complete)

    def _end_step_locked(self, complete: bool) -> None:
        if not self._in_step:
            return
        try:
            if self._gs is not None and self._gs.error is not None:  # a stats-op hook failed
                self._degrade(RuntimeError(f"stats-op hook: {self._gs.error}"))
                return
            self._watch_tick()
            self._graph_end(complete)  # the ring holds it all (hooks/graphlate.py)
        finally:
            if self._gs is not None:  # flushed by then; never left for the next trace
                self._gs.queue.clear()
            self._in_step = False
            self._root_depth = 0
            self._logits = None
            self._step_ids = None

    # -- failure handling and teardown -------------------------------------------------------
    def _degrade(self, exc: BaseException) -> None:
        if self._degraded is None:
            self._degraded = f"{type(exc).__name__}: {exc}"
            log.error("qforensics: capture error (%s); recording stops, the run continues",
                      self._degraded, exc_info=True)
        if self._late and not self._draining:
            # the steps noted whole before the error (compiled mode emits them late): kept
            self._draining = True
            try:
                self._graph_drain()
            except Exception:  # noqa: BLE001 - already degraded: what is left is lost
                pass
            finally:
                self._draining = False
        self._late.clear()
        if self._gs is not None:
            self._gs.queue.clear()

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
            if self._linger_timer is not None:  # no emission from its thread from now on
                self._linger_timer.close()
                self._linger_timer = None
            try:
                if self._in_step and not self._degraded:
                    # a step still open inside its forward (or, for an engine that ends its
                    # steps at the logits, before them) was cut short by the stop: its row
                    # says so, whatever the run's end; an implicit step (calls without a root
                    # forward) is whole
                    cut = self._root_depth > 0 or not self.adapter.logits_from_root
                    try:
                        self._end_step(complete=not cut and (
                            status is None or status.get("state") == "complete"))
                    except Exception as exc:
                        self._degrade(exc)
                if not self._degraded:
                    try:
                        self._graph_drain()  # compiled steps still waiting to be emitted
                    except Exception as exc:
                        self._degrade(exc)
                params = self._watch_close()  # the parameters as the run leaves them
                if (self._incidents or len(params)) and self._writer is not None:
                    # trips after the last step, parameters first seen bad at close
                    self._writer.submit(StepBatch(
                        steps=np.zeros(0, schema.step_dtype()),
                        records=np.zeros(0, schema.record_dtype()), chan_min=np.zeros(0),
                        chan_max=np.zeros(0), tok_absmax=np.zeros(0, np.float32),
                        input_ids=np.zeros(0, np.int64),
                        incidents=np.concatenate(self._incidents) if self._incidents
                        else np.zeros(0, schema.incident_dtype()), params=params))
                    self._incidents = []
            finally:
                self._remove_hooks()
                if self._sink is not None:
                    self._sink.remove()
                    self._sink = None
                registry.release(self.model)
                st = dict(status or {"state": "complete"})
                st["steps"] = self.step + 1
                st["calls"] = self._next_call
                if self._degraded:
                    st["capture_error"] = self._degraded
                st.update(fused.REDUCER.status())  # the CPU kernel's C reduction (qf_group)
                st["hook_path"] = self._hook_path
                if self._watch is not None:
                    st["param_watch"] = {"every": self._watch.every, "checks": self._watch.checks,
                                         "tensors": len(self._watch.watched)}
                st.update(self._graph_status())
                self._graph_close()
                if self._writer is not None:
                    self._writer.close(st)
                registry.unregister_exit(self)

    @property
    def hooks_attached(self) -> int:
        return len(self._handles)
