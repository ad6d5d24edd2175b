"""Capture inside vLLM's worker processes (`qforensics record -- python serve.py`).

vLLM runs the model in worker processes started with `spawn`; they inherit the environment, so
the bootstrap `sitecustomize` runs in each of them. There, this module waits for vLLM's model
runner module to be imported and wraps three methods of its runner classes:

- `load_model`: once the model is built, a capture with `VllmAdapter` attaches to it, with
  `{rank}` taken from vLLM's data/tensor/pipeline-parallel rank (one file per worker, never shared);
- `execute_model`: the scheduler output of the forward being run. A model forward outside it is
  a warm-up / profile / dummy run and its step is flagged `warmup`;
- `sample_tokens` (and `execute_model` when it returns the output itself): each request's
  sampled token for the step.

Meaning kept in the trace (/engine tables): one step = one engine forward; each token row ->
(request, position, prefill|decode) from the runner's input batch (host arrays only, no device
sync); the logits are the output of the model's `logits_processor` (`compute_logits`), which
ends the step. Anything this module cannot map (another vLLM version, a runner without these
methods) leaves the generic hooks of `autoattach` in charge, with one stderr line that says what
was not mapped. Nothing here may take the engine down: every wrapper calls vLLM's own method
whatever happens to capture.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import weakref
from functools import wraps
from typing import Any, Callable

from qforensics.engines.vllm_runner import enum_name, note_unmapped, running, unmapped
from qforensics.importwatch import AfterImport

log = logging.getLogger(__name__)

RUNNER_MODULES = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.cpu_model_runner")
_WRAPPED = ("load_model", "execute_model", "sample_tokens")
# vLLM's fused layers and the HF layers they hold, in order (for `diff` against an HF trace)
FUSED_NAMES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

_state: dict[str, Any] = {"patched": [], "watching": False}
_captures: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()  # id(runner)
_lock = threading.Lock()


def owns_process() -> bool:
    """True once a vLLM model runner class was patched here: the generic hooks stand aside."""
    return bool(_state["patched"])


# -- import watching -------------------------------------------------------------------------------
def install() -> None:
    """Watch for vLLM's runner modules (idempotent); patch those already imported."""
    if _state["watching"]:
        return
    _state["watching"] = True
    sys.meta_path.insert(0, AfterImport(
        RUNNER_MODULES, patch_runner_module,
        on_error=lambda name, exc: note_unmapped(f"{name}: {type(exc).__name__}: {exc}")))
    for name in RUNNER_MODULES:
        mod = sys.modules.get(name)
        if mod is not None:
            patch_runner_module(mod)
    _install_shutdown_grace()


def register_plugin() -> None:
    """vLLM general plugin (entry point group `vllm.general_plugins`, name `qforensics`): vLLM
    calls it in every process it starts. With QFORENSICS_TRACE set, capture attaches as under
    `qforensics record`, for launchers that cannot be wrapped; otherwise it does nothing."""
    if not os.environ.get("QFORENSICS_TRACE"):
        return
    try:
        install()
    except Exception as exc:  # a plugin must never stop vLLM
        sys.stderr.write(f"qforensics: vLLM plugin not installed: {exc}\n")


def patch_runner_module(module: Any) -> list[str]:
    """Wrap load_model / execute_model / sample_tokens of every *ModelRunner class defined in
    `module`. Returns the names of the classes patched."""
    done = []
    for name, cls in list(vars(module).items()):
        if not (isinstance(cls, type) and name.endswith("ModelRunner")
                and cls.__module__ == module.__name__):
            continue
        if "load_model" not in cls.__dict__ and not any(
                "load_model" in vars(b) for b in cls.__mro__[1:]):
            note_unmapped(f"{name} has no load_model (unknown vLLM version)")
            continue
        for meth in _WRAPPED:
            fn = cls.__dict__.get(meth)
            if fn is None or getattr(fn, "__qforensics_wrapped__", False):
                continue
            wrapper = {"load_model": _wrap_load, "execute_model": _wrap_execute,
                       "sample_tokens": _wrap_sample}[meth](fn)
            wrapper.__qforensics_wrapped__ = True  # type: ignore[attr-defined]
            setattr(cls, meth, wrapper)
        done.append(f"{module.__name__}.{name}")
    _state["patched"].extend(done)
    return done


# -- the wrappers (each calls vLLM's own method whatever capture does) -----------------------------
def _wrap_load(fn: Callable) -> Callable:
    @wraps(fn)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            _before_load(self)
        except Exception as exc:
            sys.stderr.write(f"qforensics: vLLM: --eager could not be applied: {exc}\n")
        out = fn(self, *args, **kwargs)
        if id(self) not in _captures:
            try:
                _attach(self)
            except Exception as exc:
                sys.stderr.write(f"qforensics: vLLM: capture not attached: {exc}\n")
        return out
    return load_model


def _wrap_execute(fn: Callable) -> Callable:
    @wraps(fn)
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        key = id(self)
        cap = _captures.get(key)
        if cap is None:
            return fn(self, scheduler_output, *args, **kwargs)
        with running(self, scheduler_output):
            out = fn(self, scheduler_output, *args, **kwargs)
        cap.adapter.on_runner_output(out)
        return out
    return execute_model


def _wrap_sample(fn: Callable) -> Callable:
    @wraps(fn)
    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = fn(self, *args, **kwargs)
        cap = _captures.get(id(self))
        if cap is not None:
            cap.adapter.on_runner_output(out)
        return out
    return sample_tokens


def _before_load(runner: Any) -> None:
    """Set on the worker before the model is built. Always: vLLM's compile cache off
    (VLLM_DISABLE_COMPILE_CACHE), so that vLLM traces the model with capture's hooks, and never
    stores that graph where a run without capture would load it. `record --eager`
    (QFORENSICS_VLLM_EAGER=1): no torch.compile, no CUDA graphs."""
    os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    if os.environ.get("QFORENSICS_VLLM_EAGER") != "1":
        return
    cfg = runner.vllm_config
    from vllm.config import CompilationMode, CUDAGraphMode

    cfg.compilation_config.mode = CompilationMode.NONE
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.NONE
    cfg.model_config.enforce_eager = True
    if hasattr(runner, "use_cuda_graph"):
        runner.use_cuda_graph = False


# -- attaching ------------------------------------------------------------------------------------
def parallel_rank(runner: Any) -> dict[str, int]:
    """vLLM's ranks for this worker: tp/pp/dp rank and sizes, and the file rank
    (dp_rank * world + global rank) that makes every worker's file its own."""
    out = {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "dp_rank": 0, "dp_size": 1,
           "global_rank": 0, "world_size": 1}
    try:
        from vllm.distributed import parallel_state as ps

        out["tp_rank"] = ps.get_tensor_model_parallel_rank()
        out["tp_size"] = ps.get_tensor_model_parallel_world_size()
        out["pp_rank"] = ps.get_pp_group().rank_in_group
        out["pp_size"] = ps.get_pp_group().world_size
    except Exception:
        pass
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            out["global_rank"], out["world_size"] = dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    try:
        pc = runner.vllm_config.parallel_config
        out["dp_rank"] = int(getattr(pc, "data_parallel_rank", 0) or 0)
        out["dp_size"] = int(getattr(pc, "data_parallel_size", 1) or 1)
    except Exception:
        pass
    out["rank"] = out["dp_rank"] * out["world_size"] + out["global_rank"]
    out["ranks"] = out["dp_size"] * out["world_size"]
    return out


def describe_engine(runner: Any, model: Any) -> dict[str, Any]:
    """What the trace metadata says about the engine: versions, ranks, compile/graph state and
    what capture cannot see, quantization, fused names -> HF names."""
    info: dict[str, Any] = {"name": "vllm"}
    try:
        import vllm

        info["version"] = str(getattr(vllm, "__version__", "unknown"))
    except Exception:
        info["version"] = "unknown"
    info["runner"] = type(runner).__name__
    info.update(parallel_rank(runner))
    blind = []
    try:
        cc = runner.vllm_config.compilation_config
        mc = runner.vllm_config.model_config
        info["compilation_mode"] = enum_name(getattr(cc, "mode", None))
        info["cudagraph_mode"] = enum_name(getattr(cc, "cudagraph_mode", None))
        info["enforce_eager"] = bool(getattr(mc, "enforce_eager", False))
        info["quantization"] = getattr(mc, "quantization", None)
        info["dtype"] = str(getattr(mc, "dtype", ""))
        # compiled mode and CUDA graphs: the layers' statistics are traced into the graph
        # (hooks/graphstats.py); what that cannot see is said in the trace's status
    except Exception as exc:
        blind.append(f"compile state unknown ({type(exc).__name__})")
    info["not_visible"] = blind
    hf: dict[str, list[str]] = {}
    methods: dict[str, str] = {}
    health: dict[str, dict[str, Any]] = {}
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in FUSED_NAMES:
            base = name[: -len(leaf)]
            hf[name] = [base + p for p in FUSED_NAMES[leaf]]
        qm = getattr(mod, "quant_method", None)
        if qm is not None:
            methods[name] = type(qm).__name__
            h = scale_health(mod)
            if h:
                health[name] = h
    info["hf_names"] = hf
    info["quant_methods"] = methods
    info["scale_health"] = health
    info["unmapped"] = unmapped()
    return info


SCALE_NAMES = ("scales", "weight_scale", "input_scale", "weight_scale_inv", "qzeros",
               "weight_zero_point", "input_zero_point")


def scale_health(module: Any) -> dict[str, Any]:
    """The quantization scales of one vLLM layer as vLLM holds them after loading (after any
    repacking): shape, dtype, non-finite and zero counts, the first non-finite index, the
    range. Read once at attach."""
    import torch

    out: dict[str, Any] = {}
    for name in SCALE_NAMES:
        t = getattr(module, name, None)
        if not isinstance(t, torch.Tensor) or t.is_meta or not t.numel():
            continue
        d: dict[str, Any] = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
        if t.is_floating_point():
            v = t.detach().float()
            fin = torch.isfinite(v)
            d["nan"] = int(torch.isnan(v).sum())
            d["inf"] = int((~fin).sum()) - d["nan"]
            d["zero"] = int((v == 0).sum())
            if not bool(fin.all()):
                idx = torch.nonzero(~fin)[0].tolist()
                d["first_nonfinite_index"] = [int(i) for i in idx]
            if bool(fin.any()):
                d["min"], d["max"] = float(v[fin].min()), float(v[fin].max())
        out[name] = d
    return out


def _attach(runner: Any) -> None:
    from qforensics.engines.vllm_capture import vllm_capture
    from qforensics.hooks.recordenv import engine_attached, options_from_env

    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    path = os.environ.get("QFORENSICS_TRACE")
    if not path:
        return
    engine = describe_engine(runner, model)
    opts = options_from_env()
    meta = dict(opts.pop("metadata", None) or {})
    meta["engine"] = engine
    src = model_source(runner)
    if src:  # vLLM's `model=` argument: what `whatif` reruns by default
        meta.setdefault("model_path", src)
    cap = vllm_capture(model, path, runner=runner, rank=engine["rank"],
                       world_size=engine["ranks"], metadata=meta, **opts)
    cap.attach()
    with _lock:
        _captures[id(runner)] = cap
    engine_attached(cap)  # record's bootstrap seals it at exit with its own
    _seal_at_process_exit(cap)
    if os.environ.get("QFORENSICS_GUARD"):  # record --guard: the guard inside vLLM
        from qforensics.engines.vllm_guard import install_guard

        install_guard(runner, model)
    for line in engine["not_visible"]:
        sys.stderr.write(f"qforensics: vLLM: cannot see: {line}\n")
    sys.stderr.write(f"qforensics: vLLM worker rank {engine['rank']}: capturing "
                     f"{type(model).__name__} into {cap.path}\n")


def model_source(runner: Any) -> str | None:
    """vLLM's ``model=`` argument: an absolute path when it names a local folder or file (a
    GGUF), else the string as given (a hub id: `whatif` then says it is not here)."""
    try:
        m = runner.vllm_config.model_config.model
    except Exception:
        return None
    if not isinstance(m, str) or not m:
        return None
    return os.path.abspath(m) if os.path.exists(m) else m


def _seal_at_process_exit(cap: Any) -> None:
    """vLLM's workers are multiprocessing children: they end with os._exit, after
    multiprocessing's own exit function but without running atexit. Seal the trace there.

    SIGTERM is how a server (or a pod) is stopped. vLLM's processes answer it with a shutdown
    of their own (the engine core leaves its busy loop, a worker raises SystemExit), which
    ends in that exit function. Sealing inside the signal handler instead would close the file
    wherever the main thread was interrupted: in the middle of a step, or inside the writer
    with its lock held. So where vLLM's own handler is in place, ours only notes the signal
    (the status says `signal`, the reader "complete ... (stopped by SIGTERM)") and hands over;
    the exit seals."""
    from multiprocessing import util

    ref = weakref.ref(cap)

    def seal() -> None:
        c = ref()
        if c is not None:
            st = {"state": "complete", "closed_by": "vLLM worker exit"}
            if _state.get("signal"):
                st["signal"] = _state["signal"]
            try:
                c.close(st)
            except Exception:
                pass

    util.Finalize(None, seal, exitpriority=100)
    _defer_sigterm_seal()


# Seconds vLLM's server gives its engine processes between SIGTERM and SIGKILL (under record)
SHUTDOWN_GRACE_S = 10.0
_ENGINE_UTILS = "vllm.v1.engine.utils"


def _install_shutdown_grace() -> None:
    """On SIGTERM vLLM's server SIGTERMs its engine process and, with the default
    `shutdown_timeout` 0, SIGKILLs it at once (its process manager waits 0 s; vLLM itself
    keeps a cleanup window only on ROCm), so no worker could ever seal its trace. Under
    `record`, the manager waits up to SHUTDOWN_GRACE_S instead: requests are still aborted at
    once (the request timeout is unchanged), the engine and its workers end as on any clean
    exit, and the workers seal their traces. Only when vLLM would wait 0 s; a timeout the user
    set is kept."""
    def patch(mod: Any) -> None:
        orig = getattr(mod, "get_engine_process_shutdown_timeout", None)
        if orig is None or getattr(orig, "_qforensics", False):
            return

        @wraps(orig)
        def with_grace(request_timeout: Any, process_timeout: Any) -> Any:
            t = orig(request_timeout, process_timeout)
            return SHUTDOWN_GRACE_S if t == 0 else t

        with_grace._qforensics = True  # type: ignore[attr-defined]
        mod.get_engine_process_shutdown_timeout = with_grace

    mod = sys.modules.get(_ENGINE_UTILS)
    if mod is not None:
        patch(mod)
    else:
        sys.meta_path.insert(0, AfterImport(
            (_ENGINE_UTILS,), patch,
            on_error=lambda name, exc: note_unmapped(f"{name}: {type(exc).__name__}: {exc}")))


def _defer_sigterm_seal() -> None:
    """Replace capture's SIGTERM handler (qforensics.hooks.registry: seal, then the previous
    handler) by one that notes the signal and calls vLLM's handler, when vLLM installed one;
    with no handler of the program's own (SIG_DFL), capture's stays: it seals and re-raises."""
    import signal

    from qforensics.hooks import registry

    if threading.current_thread() is not threading.main_thread():
        return
    try:
        h = signal.getsignal(signal.SIGTERM)
    except Exception:
        return
    prev = registry.handed_over_to(h)
    if prev is None:
        return

    def on_sigterm(signum: int, frame: Any) -> None:
        _state["signal"] = signal.Signals(signum).name
        prev(signum, frame)

    try:
        signal.signal(signal.SIGTERM, on_sigterm)
    except Exception:
        pass


def json_engine(info: dict[str, Any]) -> str:
    return json.dumps(info, default=str, sort_keys=True)
