"""`qforensics.capture(model, "trace.h5")`: forward hooks that stream per-call statistics into an
HDF5 trace.

How it stays fast and right: a hook (hooks/callhooks.py) hands each tensor to
`PendingStep.take` (hooks/pending.py), which copies a small one on its device (one op) or
reduces a large one there, so the stats are of the tensor as the hook saw it; no host sync in a
hook. At the end of the step (one top-level
forward of the captured model) the copies are reduced in a few batched ops per (shape, dtype,
device) and everything goes to the host in ONE transfer per device; the flight recorder
(hooks/recorder.py) then decides which steps keep their per-channel ranges. A long prefill that
would hold more than `pending_budget` bytes is reduced early, in the same way.

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
from qforensics.hooks import fast_take, fused, registry
from qforensics.hooks.adapter import AdapterCalls, EngineAdapter
from qforensics.hooks.callhooks import MAX_INPUTS, MAX_OUTPUTS, CallHooks
from qforensics.hooks.graphmode import GraphMode, is_compiled
from qforensics.hooks.environment import describe_environment, rank_and_world
from qforensics.hooks.modules import ModuleFilter, describe_module, ring_chunk, select_modules
from qforensics.hooks.paramwatch import DEFAULT_EVERY, ParamWatch, watched_tensors
from qforensics.hooks.pending import PendingStep
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
        pending_budget: int = 256 << 20,
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
            "pending_budget": int(pending_budget),
            "modules": modules if isinstance(modules, str) or modules is None else "custom",
            "compiled": "auto" if compiled is None else bool(compiled),
            "param_watch": int(param_watch),
        }
        self.adapter = adapter if adapter is not None else EngineAdapter()
        engine_compiles = self.adapter.compiled()
        # compiled mode (hooks/graphmode.py): torch-op hooks traced into the graph
        # the model runs eagerly (no engine compile, no torch.compile): its hooks may run a
        # module more than once in a step (a guard's rerun), so the ring keeps room for that
        self._eager_model = not (engine_compiles or compiled_wrapper or is_compiled(model))
        # the stats op's path (hooks/graphmode.py), compiled or eager, unless compiled=False
        # asks for the older eager hooks (hooks/callhooks.py)
        self._graph_mode = True if compiled is None else bool(compiled)
        self._gs = None
        self._late: collections.deque = collections.deque()  # compiled steps not yet emitted
        self._drainer = None  # compiled mode's drainer thread (hooks/drainer.py)
        self._draining = False  # `_degrade` emitting the steps noted before the error
        self._graph_lane = -1  # the last step whose outside-graph calls went to the ring
        self._graph_why: str | None = None
        self._graph_step = -1
        self._graph_first = 0
        self._unhooked: set[int] = set()  # ids of modules the adapter records (no hook)
        self._channel_step = parse_steps(channel_steps)
        self._budget = int(pending_budget)
        self._metadata = dict(metadata or {})
        self._handles: list[Any] = []
        # the C hooks folded into the modules' forwards (hooks/fast_take.py wrap_forward) rather
        # than registered as torch hooks; never where the engine's torch.compile or graphs
        # would trace the modules
        self._wrap_forward = (os.environ.get("QFORENSICS_HOOK_PATH", "auto") != "torch"
                              and not engine_compiles)
        self._hook_path = "torch"
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
        self._c_hooks = False  # hooks/fast_take.c hooks attached
        self._root_depth = 0
        self._next_call = 0
        self._step_first_call = 0
        self._step_t0 = 0.0
        self._step_ids: torch.Tensor | None = None
        self._logits: torch.Tensor | None = None
        self._pending = PendingStep()
        self._track_versions = True
        self._partial: list[dict[str, np.ndarray]] = []  # reduced early within this step
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
            self._pending.n_mod = len(chosen)
            self._pending.plan_budget = self._budget
            self._snaps = Snapshots(
                budget=self.options["snapshot_budget"],
                tile_rows=self.options["snapshot_tile_rows"],
                outlier_threshold=self.options["outlier_threshold"],
                modules=self._modules, kinds=self._kinds, gemm_ids=self._gemm_ids)
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
            if self._graph_mode:
                self._attach_graph_session(chosen)
            else:
                self._attach_eager(chosen)
            self.adapter.attach(self)
            self._attach_root(root_id, outside_graph=self._graph_mode)
        except BaseException:
            self._remove_hooks()
            self._graph_close()
            registry.release(self.model)
            if self._writer is not None:
                self._writer.close({"state": "error", "error": "attach failed"})
            raise

    def _attach_eager(self, chosen: list) -> None:
        """Eager mode: the hooks in C (hooks/fast_take.c) when the extension is already built:
        they do _on_call's work while a step runs on its plan and call _on_call otherwise."""
        cursor = self._pending.ensure_cursor()
        c_hook = fast_take.TAKER.hook_type if cursor is not None else None
        self._c_hooks = c_hook is not None
        wrapped = 0
        for mid, (name, mod, kind) in enumerate(chosen):
            if kind == "root" or id(mod) in self._unhooked:
                continue
            hook: Any = partial(self._on_call, mid, kind == "block")
            if c_hook is not None:
                hook = c_hook(self, cursor, torch.Tensor, hook, mid, kind == "block",
                              MAX_INPUTS, MAX_OUTPUTS)
                # folded into the module's forward: torch's call path without hooks
                handle = fast_take.wrap_forward(mod, hook) if self._wrap_forward else None
                if handle is not None:
                    self._handles.append(handle)
                    wrapped += 1
                    continue
            self._handles.append(mod.register_forward_hook(
                hook, with_kwargs=True, always_call=True))
        self._hook_path = "forward" if wrapped else "torch"

    def _attach_graph_session(self, chosen: list) -> None:
        """Compiled mode: graph hooks on the layers; the root's hooks run outside the graph
        (torch.compile of the whole model breaks the graph there, before and after the
        model's own code)."""
        self._c_hooks = False
        self._attach_graph(chosen, MAX_INPUTS, MAX_OUTPUTS)
        self._hook_path = "graph" if self._gs is not None else "none"

    def _attach_root(self, root_id: int, outside_graph: bool = False) -> None:
        pre: Any = self._on_root_pre
        post: Any = partial(self._on_root_post, root_id)
        if outside_graph:
            pre, post = torch._dynamo.disable(pre), torch._dynamo.disable(post)
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
        # inference tensors keep no version counter: in-place detection is off there
        self._track_versions = not torch.is_inference_mode_enabled()
        p = self._pending
        p.track = self._track_versions
        p.nograd = not torch.is_grad_enabled()
        p.keep = self._channel_step(self.step) and self.options["channel_io"] != "none"
        p.chan_limit = self.options["channel_limit"]
        snaps = self._snaps
        p.copy_above = (self.options["outlier_threshold"] if snaps is not None
                        and "first_outlier" not in snaps.snapped else float("inf"))
        # a step like an earlier one of the same key runs on that step's plan (hooks/plan.py)
        p.start((None if self._step_ids is None else tuple(self._step_ids.shape), p.keep,
                 p.track), self._next_call)
        self._logits = None
        self._partial = []
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
            if self._graph_owns_step():  # compiled: the ring holds it all (hooks/graphmode.py)
                self._graph_end(complete)
            else:
                self._graph_drain()  # steps noted before it go first
                self._reduce_pending(final=True, complete=complete)
        finally:
            if self._gs is not None:  # flushed by then; never left for the next trace
                self._gs.queue.clear()
            self._in_step = False
            self._root_depth = 0
            self._pending.clear()
            self._partial = []
            self._logits = None
            self._step_ids = None

    # -- failure handling and teardown -------------------------------------------------------
    def _degrade(self, exc: BaseException) -> None:
        if self._degraded is None:
            self._degraded = f"{type(exc).__name__}: {exc}"
            log.error("qforensics: capture error (%s); recording stops, the run continues",
                      self._degraded, exc_info=True)
        self._pending.clear()
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
                st.update(fused.REDUCER.status())  # how the step reductions ran
                st.update(self._pending.take_status())  # how the hooks' takes ran
                st["hook_path"] = self._hook_path
                if self._watch is not None:
                    st["param_watch"] = {"every": self._watch.every, "checks": self._watch.checks,
                                         "tensors": len(self._watch.watched)}
                st["hooks"] = "c" if self._c_hooks else "python"
                st.update(self._graph_status())
                self._graph_close()
                if self._writer is not None:
                    self._writer.close(st)
                registry.unregister_exit(self)

    @property
    def hooks_attached(self) -> int:
        return len(self._handles)
