"""Non-regular files given as a trace, bundle, checkpoint or replay-result path are refused
before they are opened, with exit 2 and a message naming what the path is. Each command runs as
a subprocess under a timeout, so a reader that blocks on a FIFO fails the test instead of
hanging the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
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
        ["analyze", str(SAMPLE), path],  # one of several ranks
        ["analyze", str(SAMPLE), "--reference", path],
        ["analyze", str(SAMPLE), "--json", path],  # the bare --json leaves it a trace
        ["report", path, "-o", str(tmp / "r.html")],
        ["report", str(SAMPLE), "-o", str(tmp / "r2.html"), "--replay", path],
        ["report", str(SAMPLE), "-o", str(tmp / "r3.html"), "--reference", path],
        ["diff", str(SAMPLE), path],
        ["diff", path, str(SAMPLE)],
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


def test_triage_lists_a_fifo_as_unreadable_and_goes_on(tmp_path):
    fleet = tmp_path / "fleet"
    fleet.mkdir()
    os.symlink(SAMPLE, fleet / "a.h5")
    os.mkfifo(fleet / "b.h5")  # found by the directory walk
    lone = tmp_path / "lone.h5"
    os.mkfifo(lone)  # given by name
    res = _run("triage", str(fleet), str(lone), "--workers", "1", "--quiet",
               f"--json={tmp_path / 't.json'}")
    assert res.returncode == EXIT_USAGE, res.stderr[-500:]  # unreadable traces, nothing found
    doc = json.loads((tmp_path / "t.json").read_text())
    assert (doc["traces"], doc["healthy"]) == (3, 1)
    bad = {u["path"]: u["reason"] for u in doc["unreadable"]}
    assert set(bad) == {str(fleet / "b.h5"), str(lone)}
    assert all("FIFO" in r for r in bad.values()) and not any(u["internal"]
                                                              for u in doc["unreadable"])
    # the text report names each unreadable path once, then why
    text = res.stdout.split("Unreadable", 1)[1]
    assert all(text.count(p + ":") == 1 for p in bad), text


def test_scan_never_opens_a_fifo_inside_a_model_folder(tmp_path):
    from safetensors.numpy import save_file

    only = tmp_path / "only-fifos"
    only.mkdir()
    os.mkfifo(only / "model.safetensors")
    res = _run("scan", str(only))
    assert res.returncode == EXIT_USAGE and "no .safetensors" in res.stderr, res.stderr[-500:]
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    save_file({"w": np.ones((2, 4), dtype=np.float32)}, str(mixed / "model.safetensors"))
    for name in ("config.json", "model.safetensors.index.json", "extra.safetensors"):
        os.mkfifo(mixed / name)
    res = _run("scan", str(mixed), "--json")
    assert res.returncode == 0, res.stderr[-500:]
    doc = json.loads(res.stdout)
    assert [f["file"] for f in doc["files"]] == ["model.safetensors"]
    assert doc["tensors_scanned"] == 1
