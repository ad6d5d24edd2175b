"""qforensics/lifeline.py with real processes: a parent that is SIGKILLed takes the child it
started in a session of its own with it, together with that child's own children (vLLM's
engine and workers in whatif); a child without the variable is left alone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qforensics import lifeline

# the child: watches its parent, starts a grandchild in its group, reports both pids, waits
CHILD = """
import json, subprocess, sys, time
from qforensics.lifeline import watch_parent
watching = watch_parent(0.1)
grand = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(json.dumps({"child": __import__("os").getpid(),
                                         "grand": grand.pid, "watching": watching}))
time.sleep(120)
"""

# the parent: starts the child as whatif does (own session, child_env unless told not to)
PARENT = """
import os, subprocess, sys, time
from qforensics.lifeline import child_env
env = dict(os.environ)
if sys.argv[3] == "watch":
    env = child_env(env)
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], env=env,
                 start_new_session=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, dict]:
    out = tmp_path / "pids.json"
    env = {**os.environ, "PYTHONPATH": str(Path(lifeline.__file__).parents[1])}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(out), mode], env=env)
    deadline = time.monotonic() + 60
    while not (out.exists() and out.read_text().endswith("}")):
        assert time.monotonic() < deadline, "the child never reported its pids"
        assert parent.poll() is None
        time.sleep(0.05)
    return parent, json.loads(out.read_text())


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")
def test_a_killed_parent_takes_its_child_and_grandchild(tmp_path: Path) -> None:
    parent, pids = _start(tmp_path, "watch")
    assert pids["watching"] is True
    assert _alive(pids["child"]) and _alive(pids["grand"])
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while (_alive(pids["child"]) or _alive(pids["grand"])) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pids["child"]), "the child outlived its killed parent"
    assert not _alive(pids["grand"]), "the child's own child outlived it"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")
def test_without_the_variable_nothing_watches(tmp_path: Path) -> None:
    parent, pids = _start(tmp_path, "plain")
    try:
        assert pids["watching"] is False
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        time.sleep(0.5)  # five of the watcher's intervals, had there been one
        assert _alive(pids["child"]) and _alive(pids["grand"])
    finally:
        for pid in (pids["child"], pids["grand"]):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_bad_values_do_not_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw in ("", "x", "1", "-5"):
        monkeypatch.setenv(lifeline.ENV, raw)
        assert lifeline.watch_parent() is False
        assert lifeline.ENV not in os.environ  # never handed on to this process's children
    assert lifeline.child_env({"A": "b"}) == {"A": "b", lifeline.ENV: str(os.getpid())}
