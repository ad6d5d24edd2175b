"""Attach capture (and, when asked, the guard) to the first torch model an unmodified program
runs (`qforensics record`). This module composes the two: the capture (qforensics.hooks) and the
guard (qforensics.guard) never import each other; the guard's incidents reach the capture's
trace through qforensics.incidents.

Started from the bootstrap `sitecustomize` when QFORENSICS_TRACE is set. It waits for the
program to import torch (an import hook, so programs that never import torch pay nothing), then
registers one global forward pre-hook. The first top-level module call whose module contains a
Linear-like layer is the model: capture attaches to it, begins step 0 with that call's input ids,
and the global hook goes quiet (QFORENSICS_ATTACH=all keeps watching for further models; each
one gets its own trace file, suffixed -m1, -m2, ...). The trace is sealed at interpreter exit,
on SIGTERM, and when an uncaught exception ends the program (its message goes into the trace
status). A SIGKILL loses only what was not yet flushed.

Environment: QFORENSICS_TRACE (path; "{rank}" is replaced by the rank), QFORENSICS_OPTIONS (JSON
dict of capture options), QFORENSICS_ATTACH ("first" | "all"), QFORENSICS_GUARD (a JSON object of
guard policy fields, or any other value for the defaults: also run the runtime NaN guard).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

from qforensics.hooks.recordenv import on_engine_attach, options_from_env
from qforensics.importwatch import AfterImport

log = logging.getLogger(__name__)

_state: dict[str, Any] = {"installed": False, "attached": 0, "handle": None, "done": False,
                          "captures": [], "seen": set()}


def install() -> None:
    if _state["installed"]:
        return
    _state["installed"] = True
    on_engine_attach(adopt)
    try:  # vLLM: attach where its worker builds the model (engines/vllm.py)
        from qforensics.engines import vllm as _vllm

        _vllm.install()
    except Exception as exc:
        sys.stderr.write(f"qforensics: vLLM adapter not installed: {exc}\n")
    if "torch" in sys.modules:
        _on_torch()
    else:
        sys.meta_path.insert(0, AfterImport(
            {"torch"}, lambda _m: _on_torch(), once=True,
            on_error=lambda _n, exc: sys.stderr.write(f"qforensics: capture hook set-up failed: {exc}\n")))
    prev = sys.excepthook

    def excepthook(tp: Any, value: Any, tb: Any) -> None:
        _close_all({"state": "error", "error": f"{tp.__name__}: {value}"[:2000]})
        prev(tp, value, tb)

    sys.excepthook = excepthook


def _on_torch() -> None:
    import torch.nn.modules.module as mm

    _state["handle"] = mm.register_module_forward_pre_hook(_global_pre_hook)


def _has_linear(module: Any) -> bool:
    from qforensics.layerkinds import is_linear_like

    return any(is_linear_like(m) for m in module.modules())


def _global_pre_hook(module: Any, args: Any) -> None:
    if _state["done"]:
        return
    if id(module) in _state["seen"]:
        return
    _state["seen"].add(id(module))
    if "qforensics.engines.vllm" in sys.modules and sys.modules[
            "qforensics.engines.vllm"].owns_process():
        return  # a vLLM worker: the adapter attaches at the runner's load_model
    try:
        if not _has_linear(module):
            return
        from qforensics.hooks.capture import Capture, active_capture

        if active_capture(module) is not None:
            return  # the program captures this model itself
        path = os.environ["QFORENSICS_TRACE"]
        n = _state["attached"]
        if n:
            root, ext = os.path.splitext(path)
            path = f"{root}-m{n}{ext or '.h5'}"
        cap = Capture(module, path, **options_from_env())
        cap.attach()
        _state["attached"] = n + 1
        _state["captures"].append(cap)
        # This call's own pre-hooks were collected before we attached: begin step 0 by hand,
        # with the call's keyword arguments (input_ids, the KV cache) read from the
        # dispatching frame.
        kwargs: dict[str, Any] = {}
        try:
            frame = sys._getframe(1)
            kw = frame.f_locals.get("kwargs")
            if isinstance(kw, dict):
                kwargs = kw
        except Exception:
            pass
        cap.join_running_forward(module, tuple(args), kwargs)
        policy = os.environ.get("QFORENSICS_GUARD")
        if policy:
            try:
                from qforensics.guard import guard

                try:
                    pol = json.loads(policy)
                except json.JSONDecodeError:
                    pol = None
                g = guard(module, policy=pol if isinstance(pol, dict) else None)
                g.__enter__()
                _state.setdefault("guards", []).append(g)
                g.join_running_forward(module, tuple(args), kwargs)
            except Exception as exc:
                sys.stderr.write(f"qforensics: guard not installed: {exc}\n")
        sys.stderr.write(f"qforensics: capturing {type(module).__name__} into {cap.path}\n")
        if os.environ.get("QFORENSICS_ATTACH", "first") != "all":
            _stop_watching()
    except Exception as exc:
        _stop_watching()
        sys.stderr.write(f"qforensics: could not attach capture: {exc}\n")


def adopt(cap: Any) -> None:
    """A capture an engine adapter attached: sealed at exit like ours; the generic hook stops."""
    _state["captures"].append(cap)
    _state["attached"] += 1
    _stop_watching()


def _stop_watching() -> None:
    """Remove the global hook (safe inside its own dispatch: torch iterates over a copy)."""
    _state["done"] = True
    if _state["handle"] is not None:
        _state["handle"].remove()
        _state["handle"] = None


def _close_all(status: dict[str, Any]) -> None:
    for g in _state.get("guards", []):
        try:
            g.__exit__(None, None, None)
        except Exception:
            pass
    for cap in _state["captures"]:
        try:
            cap.close(status)
        except Exception:
            pass
