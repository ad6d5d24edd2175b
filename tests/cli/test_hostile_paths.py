"""Non-regular files given as a trace, bundle, checkpoint or replay-result path are refused
before they are opened, with exit 2 and a message naming what the path is. Each command runs as
a subprocess under a timeout, so a reader that blocks on a FIFO fails the test instead of
hanging the suite."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from qforensics.errors import EXIT_USAGE

SAMPLE = Path(__file__).resolve().parents[2] / "sample_traces" / "fp16-reference.h5"
TIMEOUT_S = 60


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run([sys.executable, "-m", "qforensics.cli", *args], text=True,
                              capture_output=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"qforensics {' '.join(args)} hung on a non-regular path")


@pytest.fixture(params=["fifo", "devnull", "directory"])
def hostile(request, tmp_path) -> tuple[str, str]:
    if request.param == "fifo":
        p = tmp_path / "trace.h5"
        os.mkfifo(p)
        return str(p), "FIFO"
    if request.param == "devnull":
        return os.devnull, "character device"
    p = tmp_path / "dir.h5"
    p.mkdir()
    return str(p), "directory"


def _commands(path: str, tmp: Path) -> list[list[str]]:
    return [
        ["analyze", path],
        ["analyze", str(SAMPLE), "--reference", path],
        ["report", path, "-o", str(tmp / "r.html")],
        ["report", str(SAMPLE), "-o", str(tmp / "r2.html"), "--replay", path],
        ["diff", str(SAMPLE), path],
        ["replay", path],
        ["whatif", path, "--table"],
    ]


def test_every_reader_refuses_non_regular_paths(hostile, tmp_path):
    path, kind = hostile
    for args in _commands(path, tmp_path):
        res = _run(*args)
        assert res.returncode == EXIT_USAGE, (args, res.returncode, res.stderr[-500:])
        assert "Traceback" not in res.stderr, args
        # click refuses directories itself for options declared dir_okay=False
        assert kind in res.stderr or "is a directory" in res.stderr, (args, res.stderr[-500:])


def test_scan_refuses_fifo_and_device(tmp_path):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    for path, kind in ((str(fifo), "FIFO"), (os.devnull, "character device")):
        res = _run("scan", path)
        assert res.returncode == EXIT_USAGE, (path, res.stderr[-500:])
        assert kind in res.stderr


def test_writer_refuses_a_fifo_output(tmp_path):
    from qforensics.errors import CaptureError
    from qforensics.trace.validate import check_regular_file, non_regular_kind

    fifo = tmp_path / "out.h5"
    os.mkfifo(fifo)
    assert non_regular_kind(fifo) == "a FIFO (named pipe)"
    assert non_regular_kind(SAMPLE) is None
    with pytest.raises(CaptureError, match="FIFO"):
        check_regular_file(fifo, "trace", CaptureError)
