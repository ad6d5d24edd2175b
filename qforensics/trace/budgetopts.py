"""The trace's byte budget as an option: its default and the one parser of its environment
variable (`QFORENSICS_MAX_BYTES`), used by `qforensics record` / `demo` (cli/options.py) and by
the bootstrap (autoattach.py). Standard library only."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

__all__ = ["DEFAULT_MAX_BYTES", "MAX_BYTES_ENV", "max_bytes_from_env", "parse_max_bytes"]

DEFAULT_MAX_BYTES = 1 << 30  # 1 GiB: days of serving (every step's summary is a few bytes)
MAX_BYTES_ENV = "QFORENSICS_MAX_BYTES"

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
          "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
          "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}
_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*")


def parse_max_bytes(text: str) -> int:
    """'1073741824', '1G', '512MiB', '0' (no cap) -> bytes; units are powers of 1024.
    ValueError with the accepted forms otherwise."""
    m = _RE.fullmatch(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a byte count (e.g. 1073741824, 1G, 512MiB; 0: none)")
    return int(float(m.group(1)) * _UNITS[unit])


def max_bytes_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """The budget QFORENSICS_MAX_BYTES sets (None: unset); ValueError when malformed."""
    raw = (os.environ if environ is None else environ).get(MAX_BYTES_ENV)
    if raw is None or not raw.strip():
        return None
    try:
        return parse_max_bytes(raw)
    except ValueError as exc:
        raise ValueError(f"{MAX_BYTES_ENV}: {exc}") from None
