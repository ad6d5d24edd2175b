"""qforensics: forensics for failures of quantized LLMs.

`import qforensics` never imports torch; the capture side (`capture`, `guard`) loads it on first
use, so the analysis side runs where torch is absent.
"""

from __future__ import annotations

from typing import Any

from qforensics.version import __version__

__all__ = ["__version__", "capture", "guard", "open_trace"]


def __getattr__(name: str) -> Any:
    if name == "capture":
        from qforensics.hooks.capture import capture

        return capture
    if name == "guard":
        from qforensics.guard.runtime import guard

        return guard
    if name == "open_trace":
        from qforensics.trace.reader import open_trace

        return open_trace
    raise AttributeError(f"module 'qforensics' has no attribute {name!r}")
