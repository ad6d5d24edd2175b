"""One vLLM engine serving one what-if checkpoint, for as long as whatif needs it.

`ServedEngine` starts ``python -m qforensics.demo.vllm_serve FOLDER --score-ids IDS --serve``
in a session of its own (its whole process group, vLLM's engine and workers included, is killed
when it is closed; a whatif killed outright takes it along: qforensics/lifeline.py), waits for
its scores, then times rounds on request (`time_round`: the prompts served greedily with exactly
N new tokens; qforensics/whatif/speed.py interleaves two engines' rounds). vLLM's logs go to a
file beside the scores; when the engine fails, `VllmRunError` carries vLLM's own root cause.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from qforensics.errors import QForensicsError
from qforensics.lifeline import child_env

__all__ = ["ServedEngine", "VllmRunError", "wait_group"]

POLL_S = 0.02


class VllmRunError(QForensicsError):
    """vLLM could not serve a what-if checkpoint (exit 2, with vLLM's last words)."""


def wait_group(proc: subprocess.Popen, timeout: float) -> int | None:
    """Wait for a process started with start_new_session=True, then kill its whole group
    (children that outlive it: vLLM's workers). Its exit code, or None on timeout."""
    try:
        rc: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return rc


_LOG_PREFIX = re.compile(r"^\(\w+ pid=\d+\) [A-Z]+ \S+ \S+ \[[^\]]*\] ?")
_RAISED = re.compile(r"^(?:[\w.]+(?:Error|Exception)|Exception): ")
_WRAPPERS = ("Engine core initialization failed", "WorkerProc initialization failed")


def root_cause(stderr: str) -> str:
    """vLLM's own words for why it failed: the first exception raised that is not one of its
    wrappers ("Engine core initialization failed"), with the lines it continues on (a kernel
    table's reasons); else the last lines of stderr."""
    lines = [_LOG_PREFIX.sub("", ln.rstrip()) for ln in stderr.splitlines()]
    for i, ln in enumerate(lines):
        if _RAISED.match(ln) and not any(w in ln for w in _WRAPPERS):
            more = []
            for nxt in lines[i + 1:i + 6]:
                if not nxt.startswith(" ") or nxt.lstrip().startswith(("File ", "Traceback")):
                    break
                more.append(nxt.strip())
            return " | ".join([ln.strip(), *more])[:900]
    return " | ".join(ln.strip() for ln in lines[-4:] if ln.strip())[-600:]


class ServedEngine:
    """vllm_serve on ``folder``: `scores` once it has scored ``seqs``; `time_round` after."""

    def __init__(self, python: str, folder: Path, seqs: list[list[int]], work: Path) -> None:
        from qforensics.demo.vllm_scenarios import serve_env

        self.folder, self.work = folder, work
        self.env = child_env(serve_env())  # it ends if this process is killed
        ids = work / f"{folder.name}.ids.json"
        self.out = work / f"{folder.name}.scores.json"
        self.log = work / f"{folder.name}.log.txt"  # vLLM logs (its workers' too) go to stdout
        ids.write_text(json.dumps(seqs))
        cmd = [python, "-m", "qforensics.demo.vllm_serve", str(folder), "--score-ids",
               str(ids), "--out", str(self.out), "--serve",
               "--max-model-len", str(max(256, max(map(len, seqs)) + 8))]
        self._rounds = 0
        # its own session, output to a file: vLLM's worker processes outlive an engine that
        # died and would hold a pipe open; the whole group is killed once it is closed
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(cmd, env=self.env, stdin=subprocess.PIPE,
                                         stdout=err, stderr=subprocess.STDOUT, text=True,
                                         start_new_session=True)

    def _wait_for(self, path: Path, timeout: float, what: str) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while not path.is_file():
            if self.proc.poll() is not None:
                self.close()
                raise VllmRunError(f"vLLM could not serve {self.folder.name} (exit "
                                   f"{self.proc.returncode}): {self._why()}")
            if time.monotonic() > end:
                self.close()
                raise VllmRunError(f"vLLM did not finish {what} {self.folder.name} within "
                                   f"{timeout:.0f} s")
            time.sleep(POLL_S)
        return json.loads(path.read_text())

    def _why(self) -> str:
        why = root_cause(self.log.read_text(errors="replace"))
        if "execute_model timed out" in why:  # a forward slower than vLLM's RPC limit
            why += (f" (one forward took longer than VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS="
                    f"{self.env.get('VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS', '300')} s, vLLM's "
                    "limit per engine step: this scheme's kernel is too slow on this CPU for "
                    "the scored text; a larger value lets a slow step finish)")
        return why

    def scores(self, timeout: float) -> dict[str, Any]:
        """What vllm_serve wrote for the scored sequences (VllmRunError when it failed)."""
        return self._wait_for(self.out, timeout, "scoring")

    def time_round(self, prompts: list[list[int]], max_tokens: int, timeout: float) -> float:
        """Seconds vLLM's ``generate`` took for ``prompts``, ``max_tokens`` new tokens each."""
        self._rounds += 1
        out = self.work / f"{self.folder.name}.round{self._rounds}.json"
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens,
                                              "out": str(out)}) + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # it is gone: _wait_for says why
        got = self._wait_for(out, timeout, "a timed round of")
        if got.get("tokens") != [max_tokens] * len(prompts):
            raise VllmRunError(f"{self.folder.name}: a timed round gave {got.get('tokens')} "
                               f"new tokens, not {max_tokens} per prompt")
        return float(got["seconds"])

    def close(self) -> None:
        """End the engine (``quit``, then its whole process group)."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
        wait_group(self.proc, 30 if self.proc.poll() is None else 0)

    def __enter__(self) -> ServedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
