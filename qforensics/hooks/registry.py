"""Process-wide capture state: which model has a capture attached (refuse attaching twice), and
the exit/signal hooks that flush and seal every open trace when the interpreter exits or a
SIGTERM arrives. Hooks are global state; this module is where that state lives."""

from __future__ import annotations

import atexit
import os
import signal
import threading
import weakref
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from torch import nn


class Capture(Protocol):
    """What this module needs of a capture (qforensics.hooks.session.Capture): to seal it."""

    def close(self, status: dict[str, Any] | None = None) -> Any: ...


_ACTIVE: dict[int, "Capture"] = {}  # id(model) -> capture: refuse attaching twice
_ACTIVE_LOCK = threading.Lock()


def claim(model: "nn.Module", cap: "Capture") -> bool:
    """Mark `model` as captured by `cap`; False when another capture already holds it."""
    with _ACTIVE_LOCK:
        if id(model) in _ACTIVE:
            return False
        _ACTIVE[id(model)] = cap
        return True


def release(model: "nn.Module") -> None:
    with _ACTIVE_LOCK:
        _ACTIVE.pop(id(model), None)


def active_capture(model: "nn.Module") -> "Capture | None":
    """The capture attached to `model`, if any (the guard reports its trips there)."""
    with _ACTIVE_LOCK:
        return _ACTIVE.get(id(model))


# -- process exit / signals: flush what we have --------------------------------------------------
_OPEN: "weakref.WeakSet[Capture]" = weakref.WeakSet()
_SIG_INSTALLED = False
_EXIT_INSTALLED = False


def register_exit(cap: "Capture") -> None:
    global _SIG_INSTALLED, _EXIT_INSTALLED
    _OPEN.add(cap)
    if not _EXIT_INSTALLED:  # from any thread: a capture attached on a worker is sealed too
        _EXIT_INSTALLED = True
        atexit.register(_close_all, "exit")
    # signal handlers can only be installed from the main thread (retried on each attach)
    if not _SIG_INSTALLED and threading.current_thread() is threading.main_thread():
        _SIG_INSTALLED = True
        for sig in (signal.SIGTERM,):
            prev = signal.getsignal(sig)
            if prev in (signal.SIG_IGN,):
                continue
            signal.signal(sig, partial(_on_signal, prev))


def unregister_exit(cap: "Capture") -> None:
    _OPEN.discard(cap)


def _close_all(reason: str) -> None:
    status = ({"state": "complete", "closed_by": "interpreter exit"} if reason == "exit"
              else {"state": reason})
    for cap in list(_OPEN):
        try:
            cap.close(status)
        except Exception:
            pass


def handed_over_to(handler: Any) -> Callable | None:
    """When `handler` is capture's signal handler (seal every open trace, then hand over), the
    program's own handler it hands over to; None when `handler` is another, or when capture's
    hands over to the default action (it re-raises the signal itself)."""
    if isinstance(handler, partial) and handler.func is _on_signal and handler.args \
            and callable(handler.args[0]):
        return handler.args[0]
    return None


def _on_signal(prev: Any, signum: int, frame: Any) -> None:
    _close_all(f"signal {signal.Signals(signum).name}")
    if callable(prev):
        prev(signum, frame)
    else:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
