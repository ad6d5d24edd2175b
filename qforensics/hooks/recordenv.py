"""What `qforensics record` hands to the capture in a process it starts: the options from the
environment, and who is told when an engine adapter attaches a capture of its own.

`options_from_env` reads QFORENSICS_OPTIONS (a JSON object of capture options) and the byte
budget's QFORENSICS_MAX_BYTES (the option wins). `engine_attached(cap)` tells the listeners
(`on_engine_attach`) that an engine adapter (engines/vllm.py) attached `cap`: the bootstrap
(autoattach.py) then seals it at exit with its own and stops its generic hook. Both the
bootstrap and the adapters import this module, never each other. Never raises on bad input: it
says so on stderr and uses the defaults.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["engine_attached", "on_engine_attach", "options_from_env"]

_listeners: list[Callable[[Any], None]] = []


def options_from_env() -> dict[str, Any]:
    """Capture options from QFORENSICS_OPTIONS, with QFORENSICS_MAX_BYTES as the budget when
    the options do not set one."""
    raw = os.environ.get("QFORENSICS_OPTIONS") or "{}"
    try:
        opts = json.loads(raw)
    except json.JSONDecodeError:
        sys.stderr.write("qforensics: QFORENSICS_OPTIONS is not JSON; using defaults\n")
        opts = {}
    opts = opts if isinstance(opts, dict) else {}
    if "max_bytes" not in opts:  # the option wins over the environment variable
        from qforensics.trace.budgetopts import max_bytes_from_env

        try:
            env = max_bytes_from_env()
        except ValueError as exc:
            sys.stderr.write(f"qforensics: {exc}; using the default budget\n")
        else:
            if env is not None:
                opts["max_bytes"] = env or None
    return opts


def on_engine_attach(listener: Callable[[Any], None]) -> None:
    """Call `listener(cap)` for every capture an engine adapter attaches from now on."""
    if listener not in _listeners:
        _listeners.append(listener)


def engine_attached(cap: Any) -> None:
    """An engine adapter attached `cap`: tell the listeners (a failing one is skipped)."""
    for fn in list(_listeners):
        try:
            fn(cap)
        except Exception as exc:  # noqa: BLE001 - never stop the engine
            sys.stderr.write(f"qforensics: {exc}\n")
