"""Fixtures for the analyzer tests: synthetic traces (analyze_synth, no torch), the committed
sample traces of the real SmolLM2-135M model when present, and a CLI runner."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, os.path.dirname(__file__))

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def sample():
    def get(name: str) -> str:
        p = SAMPLES / f"{name}.h5"
        assert p.is_file(), f"sample trace {p} missing (python sample_traces/regenerate.py)"
        return str(p)
    return get
