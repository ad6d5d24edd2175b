"""The import rules of pyproject.toml ([tool.importlinter]) hold: the analysis side never imports
torch, not even lazily inside a function, the packages depend one way, record's start-up hook
(qforensics/_bootstrap) included, and no modules import each other in a circle. A rule that
breaks fails here, in CI, with import-linter's report of the offending chain."""

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
    assert "BROKEN" not in report and report.count("KEPT") == 5, report[-2000:]


def _lint_copy(tmp_path: Path, module: str, added: str) -> tuple[int, str]:
    """import-linter's exit code and report on a copy of the package where `module` (a path
    under qforensics/, no .py) ends with the lines `added`."""
    import shutil

    pkg = tmp_path / "qforensics"
    shutil.copytree(ROOT / "qforensics", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = pkg / f"{module}.py"
    target.write_text(target.read_text() + added)
    proc = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command;"
                           " lint_imports_command()"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("module", ["analyze/thresholds", "layouts/bits"])
def test_the_contracts_catch_a_lazy_torch_import(tmp_path, module):
    """The rules are not vacuous: a copy of the package whose analyzer (or whose layouts
    package, outside its torch adapters) imports torch inside a function breaks them."""
    rc, report = _lint_copy(tmp_path, module, "\n\ndef _lazy():\n    import torch  # noqa\n")
    assert rc != 0
    assert f"qforensics.{module.replace('/', '.')} -> torch" in report, report[-3000:]


def test_the_contracts_catch_a_lazy_import_circle(tmp_path):
    """A module that imports, inside a function, one that imports it (the session imports the
    registry at the top) closes a circle: broken, with the import that would open it."""
    rc, report = _lint_copy(tmp_path, "hooks/registry",
                            "\n\ndef _lazy():\n    from qforensics.hooks import session  # noqa\n")
    assert rc != 0
    assert "No cycles are allowed in qforensics.hooks" in report, report[-3000:]


def test_the_contracts_cover_records_start_up_hook(tmp_path):
    """record's sitecustomize is inside the rules: importing the CLI from it (a layer above)
    breaks them."""
    rc, report = _lint_copy(tmp_path, "_bootstrap/sitecustomize",
                            "\n\ndef _lazy():\n    import qforensics.cli  # noqa\n")
    assert rc != 0
    assert "qforensics._bootstrap.sitecustomize -> qforensics.cli" in report, report[-3000:]
