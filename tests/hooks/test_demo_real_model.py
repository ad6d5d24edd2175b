"""`qforensics demo` end to end on the real model (one failing scenario, few tokens)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from qforensics.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "analyze"))
from raw_trace import first_nonfinite_output  # noqa: E402

pytestmark = pytest.mark.model


def test_demo_writes_traces_analyses_and_reports(tmp_path):
    res = CliRunner().invoke(main, ["demo", "-o", str(tmp_path), "-s", "fp8-e4m3-nosat-act",
                                    "--max-new-tokens", "4"])
    assert res.exit_code == 0, res.output
    # the producer, derived from the trace the demo wrote with plain h5py (no qforensics code)
    step, call, module = first_nonfinite_output(tmp_path / "fp8-e4m3-nosat-act.h5")
    assert module == "model.layers.11.mlp.down_proj"
    assert (f"FAILED | first non-finite at step {step}, call {call}: {module} produced NaN from "
            "finite input") in res.output
    assert "fp16-reference" in res.output and "PASSED" in res.output
    for name in ("fp16-reference", "fp8-e4m3-nosat-act"):
        assert (tmp_path / f"{name}.h5").is_file()
        assert (tmp_path / f"{name}.html").stat().st_size > 50_000
        doc = json.loads((tmp_path / f"{name}.json").read_text())
        assert doc["schema"] == "qforensics.analyze"
