"""How the commands lay out their text: paragraphs wrapped to one width, and numbers as short
figures. Shared by analyze, diff and triage, so that their reports read alike."""

from __future__ import annotations

import math
import textwrap

WIDTH = 100


def wrap(text: str, indent: str = "  ", sub: str | None = None) -> str:
    """`text` filled to WIDTH columns: the first line after `indent`, the others after `sub`
    (default: `indent` and four spaces). Never breaks a word or at a hyphen (module names)."""
    return textwrap.fill(text, WIDTH, initial_indent=indent,
                         subsequent_indent=sub if sub is not None else indent + "    ",
                         break_on_hyphens=False, break_long_words=False)


def figure(x: float | None) -> str:
    """A figure for a reader: "-" for none, "nan", 3 significant digits when very large or very
    small, else one decimal with thousands separators from 100, 4 significant digits below."""
    if x is None:
        return "-"
    if math.isnan(x):
        return "nan"
    if abs(x) >= 1e6 or (x != 0 and abs(x) < 1e-3):
        return f"{x:.3g}"
    return f"{x:,.1f}" if abs(x) >= 100 else f"{x:.4g}"
