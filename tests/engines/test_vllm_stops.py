"""Stops and crashes of a real vLLM OpenAI server under `qforensics record`, repeated (a race
shows up in one stop of three; each stop needs a server of its own, started two at a time by
`servers`, each worker on a core of its own): a real HTTP client sends completions, then
- SIGTERM to the whole process group (how a pod is stopped) or to the server alone: the trace
  is sealed every time and the healthy run reads PASSED, the signal noted;
- SIGKILL to the whole process group mid-decode: the trace left behind opens and is analyzed,
  holds every step older than the flush interval (1 s) and says that the run was cut short.

Expectations come from the server's own answers (usage token counts) and from the tokens the
client had streamed before the kill, not from the trace."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from qforensics.analyze import PASSED, SUSPECT, analyze_trace
from qforensics.trace.reader import open_trace
from vllm_runs import free_port, one_core, recorded_server, run_recorded

pytestmark = pytest.mark.vllm

KILL_WAIT = 5.0  # seconds between the stream's count and SIGKILL (the test says why)
LONG_TOKENS = 480  # the long request: still decoding KILL_WAIT after its 5th chunk, even alone
PROMPTS = ["The capital of France is", "Quantization means", "Once upon a time"]
LONG = "The history of the Roman Empire began"


def _post(port: int, prompt: str, n: int) -> dict:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def _stream(port: int, prompt: str, n: int, got: list) -> None:
    """A streamed completion: appends (time, text) per chunk until the stream ends or breaks."""
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:  # a dead server: the read times out
            for line in r:
                line = line.strip()
                if line.startswith(b"data: {"):
                    got.append((time.monotonic(), json.loads(line[6:])))
    except Exception:  # the server went away: what arrived is what counts
        pass


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _group_gone(pgid: int, timeout: float) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.3)
    return False


def _launch(tmp: Path, model_dir: Path, core: int):
    """A recorded server started in `tmp`, its worker bound to the core-th core; not waited on."""
    port = free_port()
    cmd, env = recorded_server(tmp, model_dir, port)
    log = open(tmp / "record.log", "w")
    proc = subprocess.Popen(cmd, env={**env, **one_core(core)}, stdout=log,
                            stderr=subprocess.STDOUT, cwd=tmp,
                            start_new_session=True)  # its own process group, like a pod
    return proc, port


def _ready(tmp: Path, proc, port: int) -> None:
    deadline = time.time() + 600
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
            return
        except OSError:
            assert proc.poll() is None, (tmp / "record.log").read_text()[-4000:]
            assert time.time() < deadline, "the server did not come up"
            time.sleep(1)


STOPS = 6  # the tests below that each stop a server: 3 SIGTERM, 3 SIGKILL


@pytest.fixture(scope="module")
def healthy_run(tmp_path_factory, bf16_model_dir, quiet_machine):
    """The last test's offline run (HEALTHY_PROMPTS x 400 tokens), started in a thread before
    the servers: its check does not depend on timing; a future."""
    from concurrent.futures import ThreadPoolExecutor

    tmp = tmp_path_factory.mktemp("healthy")
    with ThreadPoolExecutor(1) as ex:
        yield ex.submit(run_recorded, tmp, bf16_model_dir, HEALTHY_PROMPTS, 400,
                        extra=["--eager"], env=one_core(-1))


@pytest.fixture(scope="module")
def servers(tmp_path_factory, bf16_model_dir, quiet_machine, healthy_run):
    """`take()` -> (folder, process, port) of a recorded server that answers. A server start
    (about a minute, mostly imports on one core) is what these tests cost, and each stop needs
    its own: two are started at once, on different cores, and each one taken, once up, starts
    the one after next, so a test finds its server up, or half started. The checks share
    nothing but the machine (the SIGKILL test's wait is sized for that)."""
    started: list = []

    def launch() -> None:
        if len(started) < STOPS:
            tmp = tmp_path_factory.mktemp("server")
            started.append((tmp, *_launch(tmp, bf16_model_dir, len(started))))

    def take():
        tmp, proc, port = started[taken[0]]
        taken[0] += 1
        _ready(tmp, proc, port)
        launch()  # the one after next starts while this one is used
        return tmp, proc, port

    taken = [0]
    launch()
    launch()
    yield take
    for _, proc, _ in started:  # any left over (a test not run, or one that failed early)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)


def _traffic(port: int, long_tokens: int) -> tuple[list, list, threading.Thread]:
    """The short completions (answered), then a long streamed one, running (>= 5 chunks)."""
    answers = [_post(port, p, 12) for p in PROMPTS]
    got: list = []
    t = threading.Thread(target=_stream, args=(port, LONG, long_tokens, got), daemon=True)
    t.start()
    while len(got) < 5 and t.is_alive():
        time.sleep(0.05)
    assert len(got) >= 5, "the long request never streamed"
    return answers, got, t


def _requests(trace):
    req = trace.engine_columns("requests")
    sampled = trace.engine_columns("sampled")
    order = np.argsort(req["first_step"], kind="stable")
    out = []
    for i in order:
        r = int(req["request"][i])
        mine = sampled["request"] == r
        out.append({"prompt_tokens": int(req["prompt_tokens"][i]),
                    "sampled": int(mine.sum()), "first_step": int(req["first_step"][i]),
                    "steps": sampled["step"][mine].tolist()})
    return out


def _same_counts(answers: list, reqs: list) -> None:
    """Each answered request: the server gave 12 tokens, and the trace holds 12 sampled (the
    messages carry what a failure needs: the server's finish reason, the trace's steps)."""
    for a, r in zip(answers, reqs):
        why = (a["choices"][0].get("finish_reason"), a["usage"], r, len(reqs))
        assert r["prompt_tokens"] == a["usage"]["prompt_tokens"], why
        assert a["usage"]["completion_tokens"] == 12, why
        assert r["sampled"] == 12, why


@pytest.mark.parametrize("trial,target", [(1, "group"), (2, "server"), (3, "group")])
def test_sigterm_seals_and_a_healthy_run_passes(trial, target, servers):
    tmp_path, proc, port = servers()
    try:
        answers, got, t = _traffic(port, 300)
        if target == "group":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            (server,) = _children(proc.pid)
            os.kill(server, signal.SIGTERM)
        rc = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = (tmp_path / "record.log").read_text()
    assert _group_gone(proc.pid, 60), "processes of the server outlived it"
    path = tmp_path / "s-0.h5"
    with open_trace(path) as tr:
        assert tr.end.complete, (tr.end.reason, log[-3000:])
        assert tr.end.reason.startswith("complete")
        if target == "group":  # the worker itself got the signal: noted
            assert "stopped by SIGTERM" in tr.end.reason
            assert tr.meta["status"].get("signal") == "SIGTERM"
        else:  # the server alone: vLLM ended its worker, which sealed at its exit
            assert tr.meta["status"].get("closed_by") == "vLLM worker exit"
        summary = f"s-0.h5: {tr.n_steps} steps; {tr.end.reason}"
        reqs = _requests(tr)
    assert summary in log, log[-3000:]  # record listed it sealed: it waited for the seal
    _same_counts(answers, reqs)
    assert len(reqs) == len(PROMPTS) + 1 and reqs[-1]["sampled"] >= 5
    f = analyze_trace(path)
    assert f.status == PASSED, f.verdict.line
    assert rc in (0, 128 + signal.SIGTERM, -signal.SIGTERM, 143), rc


@pytest.mark.parametrize("trial", [1, 2, 3])
def test_sigkill_of_the_group_mid_decode_keeps_flushed_steps(trial, servers):
    tmp_path, proc, port = servers()
    try:
        answers, got, t = _traffic(port, LONG_TOKENS)
        before = len(got)  # every one of these tokens came from a step submitted before now
        # the point of the wait: what SIGKILL must keep is every step older than the flush
        # interval (1 s), by the writer's own clock; alone, that interval plus a step (2.5 s)
        # would do; 5 s, because the next server starts beside this one (`servers`) and can
        # hold the writer back a few seconds
        time.sleep(KILL_WAIT)
        assert t.is_alive(), "the request ended before the kill: not mid-decode"
        streamed = len(got)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert _group_gone(proc.pid, 60)
    path = tmp_path / "s-0.h5"
    with open_trace(path) as tr:
        assert not tr.end.complete and "never closed" in tr.end.reason
        reqs = _requests(tr)
    _same_counts(answers, reqs)
    assert len(reqs) == len(PROMPTS) + 1
    # every token streamed KILL_WAIT before the kill came from a step older than the flush
    # interval; the engine may be ahead of the stream, so only the lower bound is sure
    assert before <= reqs[-1]["sampled"] <= LONG_TOKENS and streamed >= before
    f = analyze_trace(path)
    assert f.status == SUSPECT and "did not finish normally" in f.verdict.line
    assert "truncated" in f.verdict.line
    out = subprocess.run([sys.executable, "-m", "qforensics.cli", "analyze", str(path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "the writer never closed the file" in out.stdout


HEALTHY_PROMPTS = [
    "The capital of France is", "Quantization of large language models means",
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics state that", "def fibonacci(n):",
    "A recipe for a simple tomato soup:", "The history of the Roman Empire began",
    "Photosynthesis is the process by which",
]


def test_healthy_8x400_run_ends_complete_and_passes(healthy_run):
    """The issue's false alarm: the unquantized model, 8 prompts x 400 greedy tokens, eager,
    ended normally (the offline API's exit). It holds what the old rules fired on (here: a
    request that greedily repeats one token, read from the tokens vLLM sampled) and reads
    PASSED (docs/thresholds.md). Run beside the servers (`healthy_run`)."""

    run = healthy_run.result()
    (path,) = run["files"]
    with open_trace(path) as tr:
        assert tr.end.complete and tr.end.reason.startswith("complete")
        sampled = tr.engine_columns("sampled")
    longest = 0
    for r in np.unique(sampled["request"]):
        mine = sampled["request"] == r
        tok = sampled["token"][mine][np.argsort(sampled["step"][mine], kind="stable")]
        same = np.r_[0, np.nonzero(np.diff(tok) != 0)[0] + 1, len(tok)]
        longest = max(longest, int(np.diff(same).max()))
    assert longest >= 8, "no request looped: the old repeat rule's symptom is not in this run"
    f = analyze_trace(path)
    assert f.status == PASSED and f.precursors == [], f.verdict.line
