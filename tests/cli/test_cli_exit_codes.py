"""Exit codes: 0 healthy, 1 a FAILED/SUSPECT finding, 2 bad usage or unreadable input, 3 an
internal error. No traceback reaches the user unless QFORENSICS_DEBUG is set."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import qforensics.cli.analyze as analyze_cli
from qforensics.cli import main
from qforensics.errors import EXIT_FINDING, EXIT_INTERNAL, EXIT_OK, EXIT_USAGE

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"


def _boom(*args, **kwargs):
    raise ZeroDivisionError("a planted bug\nspanning two lines")


def test_internal_error_is_one_line_exit_3_without_traceback(monkeypatch, tmp_path):
    monkeypatch.delenv("QFORENSICS_DEBUG", raising=False)
    monkeypatch.setattr(analyze_cli, "analyze_trace", _boom)
    res = CliRunner().invoke(main, ["analyze", str(SAMPLES / "fp16-reference.h5")])
    assert res.exit_code == EXIT_INTERNAL == 3  # the documented code (0, 1, 2: test_analyze_cli)
    assert "Traceback" not in res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("Internal error: ZeroDivisionError: a planted bug spanning two")
    assert "QFORENSICS_DEBUG=1" in lines[0]


def test_internal_error_traceback_behind_env(monkeypatch):
    monkeypatch.setenv("QFORENSICS_DEBUG", "1")
    monkeypatch.setattr(analyze_cli, "analyze_trace", _boom)
    res = CliRunner().invoke(main, ["analyze", str(SAMPLES / "fp16-reference.h5")])
    assert res.exit_code == EXIT_INTERNAL
    assert "Traceback (most recent call last)" in res.stderr and "_boom" in res.stderr


@pytest.mark.parametrize("args", [
    ["analyze"],  # missing argument: click usage error
    ["analyze", "--no-such-option", "x.h5"],
    ["analyze", "/nonexistent/trace.h5"],  # QForensicsError
    ["diff", "/nonexistent/a.h5", "/nonexistent/b.h5"],
    ["report", "/nonexistent/trace.h5", "-o", "/tmp/never.html"],
])
def test_bad_usage_and_missing_input_exit_2(args):
    res = CliRunner().invoke(main, args)
    assert res.exit_code == EXIT_USAGE, res.output
    assert "Traceback" not in res.output


def test_not_hdf5_exits_2_in_a_real_process(tmp_path):
    bad = tmp_path / "garbage.h5"
    bad.write_bytes(b"not an hdf5 file at all" * 10)
    proc = subprocess.run([sys.executable, "-m", "qforensics.cli", "analyze", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_USAGE
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("Error: ") and "not an HDF5 file" in proc.stderr


def test_healthy_and_failed_samples():
    r = CliRunner()
    ok = r.invoke(main, ["analyze", str(SAMPLES / "fp16-reference.h5")])
    assert ok.exit_code == EXIT_OK and ok.output.startswith("PASSED | ")
    bad = r.invoke(main, ["analyze", str(SAMPLES / "fp8-e4m3-nosat-act.h5")])
    assert bad.exit_code == EXIT_FINDING and bad.output.startswith("FAILED | ")


def test_help_documents_exit_codes():
    res = CliRunner().invoke(main, ["--help"])
    assert res.exit_code == 0
    assert "3 an internal error" in res.output and "QFORENSICS_DEBUG" in res.output
