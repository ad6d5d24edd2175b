"""Session fixture: the real model, loaded once per process (shared with tests/whatif through
qforensics.whatif.run.load_demo)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def demo():
    from qforensics.whatif.run import load_demo

    return load_demo()
