"""The import rules of pyproject.toml ([tool.importlinter]) hold: the analysis side never imports
torch, not even lazily inside a function, and the packages depend one way. A rule that breaks
fails here, in CI, with import-linter's report of the offending chain."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    proc = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command;"
                           " lint_imports_command()"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report[-4000:]
    assert "BROKEN" not in report and report.count("KEPT") == 4, report[-2000:]


@pytest.mark.parametrize("module", ["analyze/thresholds", "layouts/bits"])
def test_the_contracts_catch_a_lazy_torch_import(tmp_path, module):
    """The rules are not vacuous: a copy of the package whose analyzer (or whose layouts
    package, outside its torch adapters) imports torch inside a function breaks them."""
    import shutil

    pkg = tmp_path / "qforensics"
    shutil.copytree(ROOT / "qforensics", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = pkg / f"{module}.py"
    target.write_text(target.read_text() + "\n\ndef _lazy():\n    import torch  # noqa\n")
    proc = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command;"
                           " lint_imports_command()"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    report = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"qforensics.{module.replace('/', '.')} -> torch" in report, report[-3000:]
