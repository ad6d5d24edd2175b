"""Where a guard's incidents go: a per-model table of sinks, so the capture (hooks/) and the
guard (guard/) meet here instead of importing each other.

A capture registers its ``record_incident`` for the model it watches (`register_sink`) and
unregisters it when it closes; the guard reports each incident with `report_incident`, which
reaches every sink registered for that model (none: the incident stays in ``Guard.incidents``
only). Torch-free; keyed by ``id(model)`` under a lock, so it is safe from any thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["IncidentSink", "register_sink", "report_incident", "sinks_for"]

log = logging.getLogger(__name__)

IncidentSink = Callable[..., None]  # (module, action, *, nan_count, inf_count, detail)

_SINKS: dict[int, list[IncidentSink]] = {}
_LOCK = threading.Lock()


class _Registration:
    """Handle from `register_sink`: ``remove()`` unregisters (idempotent)."""

    def __init__(self, key: int, sink: IncidentSink) -> None:
        self._key, self._sink = key, sink

    def remove(self) -> None:
        with _LOCK:
            sinks = _SINKS.get(self._key)
            if sinks and self._sink in sinks:
                sinks.remove(self._sink)
                if not sinks:
                    del _SINKS[self._key]


def register_sink(model: Any, sink: IncidentSink) -> _Registration:
    """Send the incidents reported for ``model`` to ``sink`` until the handle is removed."""
    with _LOCK:
        _SINKS.setdefault(id(model), []).append(sink)
    return _Registration(id(model), sink)


def sinks_for(model: Any) -> list[IncidentSink]:
    with _LOCK:
        return list(_SINKS.get(id(model), ()))


def report_incident(model: Any, module: str, action: str, *, nan_count: int = 0,
                    inf_count: int = 0, detail: str = "") -> int:
    """Hand one incident to every sink of ``model``; returns how many took it. A failing sink
    is logged, never raised: reporting must not break the run."""
    n = 0
    for sink in sinks_for(model):
        try:
            sink(module, action, nan_count=nan_count, inf_count=inf_count, detail=detail)
            n += 1
        except Exception as exc:
            log.warning("qforensics: could not record an incident (%s)", exc)
    return n
