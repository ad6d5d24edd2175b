"""The report's text pieces: a `Segment` is plain text plus a style (code, number, bad), so the
template can emphasize module names and numbers while escaping every piece (nothing here is
HTML; trace strings stay plain text). Built by the causal chain (`qforensics.reports.narrative`)
and the recommendations (`qforensics.reports.recommendations`) alike. No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass

from qforensics.reports.facts import fmt_num

__all__ = ["Segment", "code", "joined", "num", "plain"]


@dataclass(frozen=True)
class Segment:
    text: str
    kind: str = ""  # "" | "code" | "num" | "bad"


def code(s: str) -> Segment:
    """A module name, a command, a format: shown as code."""
    return Segment(str(s), "code")


def num(v: object) -> Segment:
    """A number (formatted as the report formats numbers), or a string already formatted."""
    return Segment(v if isinstance(v, str) else fmt_num(v), "num")


def plain(s: str) -> Segment:
    return Segment(s)


def joined(items: list[list[Segment]], last: str = " and ") -> list[Segment]:
    """The items, separated by commas and `last` before the last one."""
    out: list[Segment] = []
    for i, it in enumerate(items):
        if i:
            out.append(plain(last if i == len(items) - 1 else ", "))
        out.extend(it)
    return out
