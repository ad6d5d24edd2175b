"""Read and validate a replay result JSON (schema `qforensics.replay`) for the report.

The file is untrusted input, like a trace: the schema name and major version are checked, every
field the report shows is type-checked, strings are length-capped, and nothing else in the
document is used. Unknown keys are ignored (docs/replay.md: consumers MUST ignore keys they do
not know). No torch import.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from qforensics.errors import UsageError
from qforensics.jsondoc import VERSION_KEY, schema_problem
from qforensics.trace import validate

__all__ = ["REPLAY_SCHEMA", "ReplayEntry", "ReplaySummary", "load_replay_result",
           "parse_replay_result"]

REPLAY_SCHEMA = "qforensics.replay"
MAX_BYTES = 16 << 20
MAX_RESULTS = 64
MAX_STR = 2000
VERDICTS = ("KERNEL FAULT", "KERNEL DIVERGES", "DATA", "NOT REPRODUCED", "INCONCLUSIVE")
# keys of a result's `first` record worth a row in the report, in display order
FIRST_KEYS = ("kind", "size", "error", "buffer", "relation", "distance", "space", "kernel",
              "function", "block", "thread", "source", "line", "address", "name", "number",
              "call", "message")


@dataclass(frozen=True)
class ReplayEntry:
    """One leg's verdict (kernel, launcher, sanitizer)."""

    verdict: str
    path: str
    summary: str
    reason: str | None
    errors: int
    first: list[tuple[str, str]] = field(default_factory=list)  # (key, value) rows, as text

    @property
    def line(self) -> str:
        return f"{self.verdict} | {self.summary}"

    @property
    def failing(self) -> bool:
        return self.verdict in ("KERNEL FAULT", "KERNEL DIVERGES", "DATA")


@dataclass(frozen=True)
class ReplaySummary:
    """The validated content of a replay result document."""

    source: str
    version: str
    created_by: str | None
    bundle: str | None
    call_index: int | None
    module: str | None
    shapes: list[tuple[str, str]]
    tile: list[tuple[str, str]]
    results: list[ReplayEntry]

    @property
    def headline(self) -> ReplayEntry | None:
        """The entry to show first: a failing one, else a GPU measurement, else the first."""
        for e in self.results:
            if e.failing:
                return e
        for e in self.results:
            if e.verdict != "INCONCLUSIVE":
                return e
        return self.results[0] if self.results else None


def _cap(s: str) -> str:
    return s if len(s) <= MAX_STR else s[:MAX_STR] + "..."


def _opt_str(doc: dict[str, Any], key: str, where: str) -> str | None:
    v = doc.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise UsageError(f"{where}: '{key}' must be a string or null, found {type(v).__name__}")
    return _cap(v)


def _opt_int(doc: dict[str, Any], key: str, where: str) -> int | None:
    v = doc.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise UsageError(f"{where}: '{key}' must be an integer or null, found {type(v).__name__}")
    return v


def _scalar_text(v: Any) -> str | None:
    """A JSON scalar (or short list of scalars) as display text; None for anything else."""
    if v is None:
        return None
    if isinstance(v, (bool, int, float, str)):
        return _cap(str(v))
    if isinstance(v, list) and len(v) <= 16 and all(
            isinstance(x, (bool, int, float, str)) or x is None for x in v):
        return _cap(json.dumps(v))
    return None


def _rows(obj: Any, where: str, keys: tuple[str, ...] | None = None) -> list[tuple[str, str]]:
    if obj is None:
        return []
    if not isinstance(obj, dict):
        raise UsageError(f"{where}: must be an object or null, found {type(obj).__name__}")
    order = keys if keys is not None else tuple(str(k) for k in obj)
    out = []
    for k in order:
        if k in obj:
            text = _scalar_text(obj[k])
            if text is not None:
                out.append((_cap(str(k)), text))
    return out[:64]


def _entry(raw: Any, where: str) -> ReplayEntry:
    if not isinstance(raw, dict):
        raise UsageError(f"{where}: each result must be an object, found {type(raw).__name__}")
    verdict = raw.get("verdict")
    if verdict not in VERDICTS:
        raise UsageError(f"{where}: 'verdict' must be one of {', '.join(VERDICTS)}, "
                         f"found {str(verdict)[:40]!r}")
    path = raw.get("path")
    summary = raw.get("summary")
    if not isinstance(path, str) or not isinstance(summary, str):
        raise UsageError(f"{where}: 'path' and 'summary' must be strings")
    errors = raw.get("errors", 0)
    if isinstance(errors, bool) or not isinstance(errors, int) or errors < 0:
        raise UsageError(f"{where}: 'errors' must be a non-negative integer")
    details = raw.get("details", {})
    if details is not None and not isinstance(details, dict):
        raise UsageError(f"{where}: 'details' must be an object")
    return ReplayEntry(verdict=verdict, path=_cap(path), summary=_cap(summary),
                       reason=_opt_str(raw, "reason", where), errors=errors,
                       first=_rows(raw.get("first"), f"{where}.first", FIRST_KEYS))


def parse_replay_result(doc: Any, source: str = "<replay result>") -> ReplaySummary:
    """Validate a decoded replay result document. Raises UsageError saying what is wrong."""
    problem = schema_problem(doc, REPLAY_SCHEMA)
    if problem is not None:
        raise UsageError(f"{source}: not a replay result this qforensics reads ({problem}); "
                         f"write one with `qforensics replay TRACE --json result.json`")
    results = doc.get("results")
    if not isinstance(results, list):
        raise UsageError(f"{source}: 'results' must be a list")
    if len(results) > MAX_RESULTS:
        raise UsageError(f"{source}: more than {MAX_RESULTS} results")
    return ReplaySummary(
        source=source,
        version=str(doc[VERSION_KEY])[:20],
        created_by=_opt_str(doc, "created_by", source),
        bundle=_opt_str(doc, "bundle", source),
        call_index=_opt_int(doc, "call_index", source),
        module=_opt_str(doc, "module", source),
        shapes=_rows(doc.get("shapes"), f"{source}: shapes"),
        tile=_rows(doc.get("tile"), f"{source}: tile"),
        results=[_entry(r, f"{source}: results[{i}]") for i, r in enumerate(results)],
    )


def load_replay_result(path: str | os.PathLike[str]) -> ReplaySummary:
    """Read and validate a replay result file written by `qforensics replay --json`."""
    p = os.fspath(path)
    validate.check_regular_file(p, "replay result", UsageError)  # a FIFO would block the read
    try:
        size = os.path.getsize(p)
        if size > MAX_BYTES:
            raise UsageError(f"{p}: replay result larger than {MAX_BYTES >> 20} MiB")
        with open(p, "rb") as fh:
            raw = fh.read(MAX_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"{p}: cannot read the replay result ({exc.strerror or exc})") from exc
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise UsageError(f"{p}: the replay result is not valid JSON ({exc})") from exc
    return parse_replay_result(doc, p)
