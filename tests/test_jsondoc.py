"""The one JSON encoder: non-finite floats become "nan" / "inf" / "-inf" wherever they sit, no
bare NaN is ever written, the envelope carries one version key, and readers get the floats
back."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from qforensics import jsondoc


@dataclass
class _Point:
    json_type: ClassVar[str] = "point"
    x: float
    tags: tuple[str, ...] = ()


def test_non_finite_values_become_strings_at_any_depth():
    doc = {"a": math.nan, "b": [1.5, -math.inf, {"c": np.float32("inf")}],
           "d": np.array([0.0, np.nan]), "e": _Point(math.inf, ("t",)), 3: np.int64(7)}
    text = jsondoc.dumps(doc)
    back = json.loads(text, parse_constant=lambda name: pytest.fail(f"bare {name}"))
    assert back == {"a": "nan", "b": [1.5, "-inf", {"c": "inf"}], "d": [0.0, "nan"],
                    "e": {"x": "inf", "tags": ["t"], "type": "point"}, "3": 7}
    assert [jsondoc.read_float(v) for v in ("inf", "-inf", 2, None, True, "x")] == \
        [math.inf, -math.inf, 2.0, None, None, None]
    assert math.isnan(jsondoc.read_float("nan"))


def test_envelope_puts_schema_and_its_version_first():
    doc = jsondoc.document("qforensics.replay", {"version": "stale", "results": []})
    assert list(doc) == ["schema", "version", "results"]
    assert doc["version"] == jsondoc.SCHEMAS["qforensics.replay"]


@pytest.mark.parametrize("doc, words", [
    ([], "not a JSON object"),
    ({"schema": "qforensics.scan", "version": "1.0"}, "expected 'qforensics.replay'"),
    ({"schema": "qforensics.replay", "schema_version": "2.0"}, "'version' must be a string"),
    ({"schema": "qforensics.replay", "version": "99.0"}, "newer than this qforensics"),
    ({"schema": "qforensics.replay", "version": "1.4"}, "older than this qforensics"),
])
def test_schema_problem_says_what(doc, words):
    assert words in jsondoc.schema_problem(doc, "qforensics.replay")


def test_schema_problem_accepts_a_newer_minor():
    major = jsondoc.SCHEMAS["qforensics.replay"].split(".")[0]
    assert jsondoc.schema_problem({"schema": "qforensics.replay", "version": f"{major}.9"},
                                  "qforensics.replay") is None


def test_write_makes_the_folder(tmp_path: Path):
    p = jsondoc.write({"x": -math.inf}, tmp_path / "new" / "d.json")
    assert p.read_text().endswith("\n") and json.loads(p.read_text()) == {"x": "-inf"}
