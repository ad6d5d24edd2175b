"""Where qforensics keeps what it builds once and reuses: one root for all of it.

`cache_root()` is $QFORENSICS_CACHE_DIR, else $QFORENSICS_CACHE (the older name, still read),
else $XDG_CACHE_HOME/qforensics, else ~/.cache/qforensics. Under it: `kernels/` (capture's C
pieces, hooks/fused.py), `replay/` (replay's nvcc builds), `llmc/` (llmcompressor's
checkpoints, whatif/llmc.py) and the demo model's conversions (demo/model.py). Whoever loads
code from here checks that nobody else can write it (hooks/fused.py `trusted`). Standard
library only.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root"]


def cache_root() -> Path:
    """The one cache root (see the module docstring)."""
    base = os.environ.get("QFORENSICS_CACHE_DIR") or os.environ.get("QFORENSICS_CACHE")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg or Path.home() / ".cache") / "qforensics"
