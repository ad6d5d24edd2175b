"""The one JSON encoder of every document qforensics writes, and the envelope they share.

Documents (SCHEMAS, the one list of their names and versions): analyze and diff findings, the
scan report, the triage fleet, the replay result and the what-if comparison; the demo's analysis
and replay's repro geometry use the same encoder. Each document starts with
``{"schema": "qforensics.<kind>", "version": "MAJOR.MINOR", ...}``: `version` is the schema's
version and the only spelling of a version key (`created_by` names the qforensics that wrote a
document where one says so). A reader checks both first (`schema_problem`); renaming or removing
a key bumps the major version, adding one the minor.

One non-finite policy: JSON has no NaN or Infinity, so a non-finite float becomes the string
``"nan"``, ``"inf"`` or ``"-inf"``, wherever it sits in the document, and the encoder never
writes a bare NaN (``allow_nan=False``). `read_float` is the inverse for one field,
`restore_nonfinite` for a whole value. Traces use the same policy for their JSON attributes and
cells (`trace.layout.json_attr`, `trace.validate.parse_json`). Torch-free and numpy-free (numpy
scalars and arrays are met by duck typing).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any

__all__ = ["NONFINITE", "SCHEMAS", "SCHEMA_KEY", "VERSION_KEY", "document", "dumps",
           "has_nonfinite_text", "json_float", "jsonable", "read_float", "restore_nonfinite",
           "schema_problem", "write"]

SCHEMA_KEY = "schema"
VERSION_KEY = "version"
SCHEMAS = {  # every document qforensics writes: name -> version (where it is described)
    "qforensics.analyze": "1.0",  # analyze --json, one trace or several: docs/analyze-json.md
    "qforensics.diff": "1.0",  # diff --json: docs/analyze-json.md
    "qforensics.scan": "1.0",  # scan --json: docs/scan.md
    "qforensics.triage": "1.0",  # triage --json: docs/triage.md
    "qforensics.replay": "3.0",  # replay --json, read by report --replay: docs/replay.md
    "qforensics.whatif": "1.1",  # whatif --json: docs/whatif.md
}
NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def json_float(x: float) -> float | str:
    """A float as JSON holds it: itself when finite, else "nan", "inf" or "-inf"."""
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def read_float(v: Any) -> float | None:
    """The inverse of json_float for a reader: a number, or one of the non-finite strings, as a
    float; None for anything else (null, a bool, other text)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        return NONFINITE.get(v)
    return None


def restore_nonfinite(value: Any) -> Any:
    """The inverse of the policy over a whole parsed value: every "nan", "inf" and "-inf"
    string (in a list or as an object's value; keys stay text) becomes its float."""
    if isinstance(value, str):
        return NONFINITE.get(value, value)
    if isinstance(value, dict):
        return {k: restore_nonfinite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [restore_nonfinite(v) for v in value]
    return value


def has_nonfinite_text(raw: str) -> bool:
    """Whether JSON text may hold a string of the policy (cheap: no parse)."""
    return '"nan"' in raw or '"inf"' in raw or '"-inf"' in raw


def jsonable(obj: Any) -> Any:
    """Dataclasses, dicts, lists, tuples, enums, paths, numpy scalars and arrays -> plain JSON
    values, non-finite floats as strings. A dataclass is its fields; one with a class attribute
    `json_type` also gets ``"type": json_type``. Anything else unknown becomes its str()."""
    if is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: jsonable(getattr(obj, f.name)) for f in fields(obj)}
        kind = getattr(type(obj), "json_type", None)
        if isinstance(kind, str):
            out["type"] = kind
        return out
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, Enum):
        return jsonable(obj.value)
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if hasattr(obj, "tolist") and callable(obj.tolist) and getattr(obj, "ndim", 0):
        return jsonable(obj.tolist())  # a numpy array
    if hasattr(obj, "item") and callable(obj.item):  # a numpy scalar
        obj = obj.item()
    if isinstance(obj, bool):
        return obj
    if isinstance(obj, int):
        return obj
    if isinstance(obj, float):
        return json_float(obj)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    return str(obj)


def document(schema: str, body: dict[str, Any]) -> dict[str, Any]:
    """The envelope: `schema` and its `version` (from SCHEMAS) first, then the body's keys."""
    return {SCHEMA_KEY: schema, VERSION_KEY: SCHEMAS[schema],
            **{k: v for k, v in body.items() if k not in (SCHEMA_KEY, VERSION_KEY)}}


def schema_problem(doc: Any, schema: str) -> str | None:
    """What keeps a reader of this qforensics from reading `doc` as `schema`, in words (None:
    nothing). The major version must be this one's; a newer minor only adds keys."""
    if not isinstance(doc, dict):
        return "not a JSON object"
    if doc.get(SCHEMA_KEY) != schema:
        return f"schema {str(doc.get(SCHEMA_KEY))[:60]!r}, expected {schema!r}"
    ver = doc.get(VERSION_KEY)
    if not isinstance(ver, str) or not ver.split(".")[0].isdigit():
        return f"{VERSION_KEY!r} must be a string like \"1.0\", found {str(ver)[:20]!r}"
    major, ours = int(ver.split(".")[0]), int(SCHEMAS[schema].split(".")[0])
    if major > ours:
        return (f"version {ver[:20]} is newer than this qforensics reads ({ours}.x); upgrade "
                "qforensics")
    if major < ours:
        return f"version {ver[:20]} is older than this qforensics reads ({ours}.x)"
    return None


def dumps(doc: Any, indent: int | None = 2, *, sort_keys: bool = False) -> str:
    """`doc` as JSON text under the one non-finite policy (never a bare NaN or Infinity)."""
    return json.dumps(jsonable(doc), indent=indent, allow_nan=False, sort_keys=sort_keys)


def write(doc: Any, path: str | os.PathLike[str]) -> Path:
    """Write `doc` to `path` (its folder made if missing), ending with a newline."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(dumps(doc) + "\n", encoding="utf-8")
    return p
