"""Fixtures for the report tests: sample traces (committed copies, else synthetic ones), the
reports written from them once per session, a hostile-names trace. Headless Chromium (the
`browser` fixture) is tests/conftest.py's; the constants tests import are report_inputs.py's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from report_inputs import HOSTILE_NAMES, HOSTILE_TEXT  # noqa: E402
from synth import write_synthetic_trace  # noqa: E402

ROOT = HERE.parents[1]
SAMPLES = ROOT / "sample_traces"


def sample_traces() -> list[Path]:
    return sorted(SAMPLES.glob("*.h5"))


@pytest.fixture(scope="session")
def traces(tmp_path_factory) -> dict[str, Path]:
    """name -> trace: the committed sample traces when present, else synthetic ones."""
    found = {p.stem: p for p in sample_traces()}
    if found:
        return found
    d = tmp_path_factory.mktemp("synthetic")
    return {"synthetic-fail": write_synthetic_trace(d / "synthetic-fail.h5"),
            "synthetic-ok": write_synthetic_trace(d / "synthetic-ok.h5", fail=False, seed=1)}


@pytest.fixture(scope="session")
def failing_trace(traces) -> Path:
    return traces.get("fp8-e4m3-nosat-act") or traces["synthetic-fail"]


@pytest.fixture(scope="session")
def hostile_trace(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hostile")
    return write_synthetic_trace(
        d / "hostile.h5", names=HOSTILE_NAMES, text=HOSTILE_TEXT,
        environment={"host": "<b>evil-host</b>",
                     "scenario": "</style><script>window.__pwned=5</script>"})


@pytest.fixture(scope="session")
def reports(traces, hostile_trace, tmp_path_factory) -> dict[str, Path]:
    """name -> HTML report, written once per session (the hostile one included)."""
    from qforensics.reports import write_report

    d = tmp_path_factory.mktemp("reports")
    out = {}
    for name, path in {**traces, "hostile": hostile_trace}.items():
        out[name] = write_report(path, d / f"{name}.html").path
    return out
