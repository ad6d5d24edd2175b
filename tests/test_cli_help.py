"""Every command is listed, documented, and its --help ends with an example."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from qforensics.cli import COMMANDS, main


def test_every_command_loads_and_is_listed():
    res = CliRunner().invoke(main, ["--help"])
    assert res.exit_code == 0
    for name in COMMANDS:
        assert name in res.output, f"{name} missing from qforensics --help"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_ends_with_an_example(name):
    res = CliRunner().invoke(main, [name, "--help"])
    assert res.exit_code == 0, res.output
    tail = res.output[res.output.rfind("Example"):]
    assert "Example" in res.output and f"qforensics {name}" in tail, res.output
    usage = (Path(__file__).resolve().parent.parent / "docs" / "usage.md").read_text()
    assert f"qforensics {name}" in usage, f"docs/usage.md does not document {name}"


def test_version_is_the_installed_distributions():
    from importlib.metadata import version

    res = CliRunner().invoke(main, ["--version"])
    assert res.exit_code == 0
    assert res.output == f"qforensics, version {version('qforensics')}\n"


def test_import_does_not_load_torch():
    code = ("import sys, qforensics, qforensics.trace, qforensics.cli; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
