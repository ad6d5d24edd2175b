"""`qforensics.capture(model, "trace.h5")`: the public entry point of the capture side.

The implementation is split along its seams: `session` (the Capture session and its hooks),
`reduce` (device reductions), `assemble` (host assembly into step batches), `snapshots` (full
tensors of the calls that matter) and `registry` (which model is captured; exit and signal
flushing). This module keeps the historical import path `qforensics.hooks.capture` working.
"""

from __future__ import annotations

from qforensics.hooks.registry import active_capture
from qforensics.hooks.session import Capture, capture

__all__ = ["Capture", "active_capture", "capture"]
