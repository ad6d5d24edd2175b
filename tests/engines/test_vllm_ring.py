"""The flight recorder inside the real vLLM engine: decode steps of two requests (two token rows
each) go to the ring, the prefill is kept, and a NaN that starts deep into the generation is still found with
its channels and the window before it.

The failure: the rotary cos/sin cache row of one position (past the prompt) has one NaN, set in
the running engine through vLLM's own `LLM.apply_model`. Every layer's attention turns that
position's query and key non-finite, so the step that computes that position is the first bad
one; every later step reads the NaN key from the KV cache. Expectations come from that
construction (the position) and from vLLM's outputs, never from qforensics' own results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from qforensics.trace import schema
from qforensics.trace.reader import open_trace
from vllm_runs import PROMPT_A, PROMPT_B

pytestmark = pytest.mark.vllm

BAD_POSITION = 48
MAX_TOKENS = 60
RING, WINDOW = 16, 8

SERVE = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine in this process: apply_model runs here
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main():
    import torch
    from vllm import LLM, SamplingParams

    model_dir, pos, n, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    llm = LLM(model=model_dir, dtype="bfloat16", enforce_eager=True, max_model_len=512, seed=0)

    def corrupt(model):
        hit = 0
        for mod in model.modules():
            cache = getattr(mod, "cos_sin_cache", None)
            if isinstance(cache, torch.Tensor) and cache.shape[0] > pos:
                cache[pos, 0] = float("nan")
                hit += 1
        return hit

    hits = llm.apply_model(corrupt)
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    outs = llm.generate({prompts!r}, params, use_tqdm=False)
    with open(out, "w") as f:
        json.dump({{"hits": hits, "prompt_ids": [list(o.prompt_token_ids) for o in outs],
                   "token_ids": [list(o.outputs[0].token_ids) for o in outs]}}, f)


if __name__ == "__main__":
    main()
"""


@pytest.fixture(scope="module")
def late_nan_run(tmp_path_factory, bf16_model_dir) -> dict:
    tmp = tmp_path_factory.mktemp("vllm-late-nan")
    script = tmp / "serve_late_nan.py"
    script.write_text(SERVE.format(prompts=[PROMPT_A, PROMPT_B]))
    out = tmp / "out.json"
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [repo] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])),
        "QFORENSICS_OPTIONS": json.dumps({"ring_steps": RING, "trigger_window": WINDOW})}
    proc = subprocess.run(
        [sys.executable, "-c", "from qforensics.cli import main; main()", "record", "-o",
         str(tmp / "t-{rank}.h5"), "--", sys.executable, str(script), str(bf16_model_dir),
         str(BAD_POSITION), str(MAX_TOKENS), str(out)],
        env=env, capture_output=True, text=True, timeout=900, cwd=tmp, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"outputs": json.loads(out.read_text()), "trace": tmp / "t-0.h5",
            "stderr": proc.stderr}


def test_a_late_nan_is_found_with_its_channels_and_the_trace_stays_bounded(late_nan_run):
    from qforensics.analyze.analyzer import analyze_trace

    res = late_nan_run["outputs"]
    assert sum(res["hits"]) >= 1  # the corruption reached the engine's model
    for ids, toks in zip(res["prompt_ids"], res["token_ids"]):  # a decode step, deep in
        assert len(ids) < BAD_POSITION < len(ids) + MAX_TOKENS - 1 and len(toks) == MAX_TOKENS
    path = late_nan_run["trace"]
    with open_trace(path) as t:
        steps = t.engine_table("steps")
        rows = t.engine_table("rows")
        warm = set(steps["step"][steps["warmup"] == 1].tolist())
        prefill = set(rows["step"][rows["phase"] == 0].tolist())
        at_bad = rows[(rows["position"] == BAD_POSITION) & (rows["phase"] == 1)]
        assert len(at_bad) == 2  # each request reaches the position once
        bad_step = int(at_bad["step"].min())
        # decode steps carry a row per request: two rows, yet they are not prefills
        decode = sorted(set(rows["step"][rows["phase"] == 1].tolist()) - prefill)
        assert (rows[rows["step"].isin(decode[:10])].groupby("step").size() == 2).all()
        assert len(decode) >= MAX_TOKENS - 2 and bad_step in decode
        # the failure starts where the construction puts it
        bad_steps = t.nonfinite_record_steps()
        assert int(bad_steps.min()) == bad_step
        cols = t.record_columns(["step", "chan_offset", "nan_count"])
        with_channels = set(np.unique(cols["step"][cols["chan_offset"] >= 0]).tolist())
        # kept: the prefill, the failing step and every later one (all fail, all under
        # trigger_limit), and the window before it (copied out of the ring)
        assert prefill <= with_channels
        assert {s for s in decode if s >= bad_step} <= with_channels
        assert set(range(bad_step - WINDOW, bad_step)) <= with_channels
        # bounded: warm-up forwards and the clean decode steps before the last ring window
        # keep no channel ranges
        before_ring = {s for s in decode if s < bad_step - RING}
        assert before_ring and not (before_ring & with_channels)
        assert not (warm & with_channels)
        # the first bad step's records carry their channel ranges
        recs = t.records(bad_step)
        nan_recs = recs[recs["nan_count"] > 0]
        assert len(nan_recs) and (nan_recs["chan_offset"] >= 0).any()
        r = nan_recs[nan_recs["chan_offset"] >= 0].iloc[0]
        assert t.channel_ranges(r) is not None
        first_in = recs[(recs["io"] == schema.IO_INPUT) & (recs["nan_count"] > 0)]
        assert len(first_in)
    with h5py.File(path, "r") as f:
        promoted = set(f["channels/promoted/step"][:].tolist())
        # a ring slot is written as whole chunks, one HDF5 call each: sized from the layers'
        # widths, a decode step's channel block (every hooked input and output of 30 blocks)
        # takes a handful, not the 67 of 4096-wide chunks (vLLM's repacked linears keep an
        # empty weight, which the width used to be read from)
        count = int(f["ring/count"][:].max())
        chunk = f["ring/min"].chunks[1]
    assert promoted == set(range(bad_step - WINDOW, bad_step))
    assert count > 100_000 and -(-count // chunk) <= 8, (count, chunk)
    f = analyze_trace(path)
    assert f.first_nonfinite is not None and f.first_nonfinite.step == bad_step


def test_each_request_reaching_the_bad_position_went_bad_on_its_own(late_nan_run):
    """Both requests go bad when each computes the corrupted rotary position, the later one in
    a forward where the other is already bad: analyze names the position (one spot, both
    requests), never a spread (issue 42, item 5). Expected from the construction: the
    position, and from vLLM's prompts: which request reaches it first."""
    from qforensics.analyze.analyzer import analyze_trace

    res = late_nan_run["outputs"]
    f = analyze_trace(late_nan_run["trace"])
    eng = f.engine
    assert eng is not None
    went = {b.request_id: b for b in eng.went_bad}
    assert len(went) == 2, [b.line for b in eng.went_bad]
    assert {b.position for b in went.values()} == {BAD_POSITION}
    assert {b.kind for b in went.values()} == {"independent_same_position"}, \
        [b.line for b in eng.went_bad]
    assert all(not b.spread_from and not b.kv_from for b in went.values())
    # the shorter prompt needs more decode steps to reach the position: it goes bad later
    steps = sorted(b.step for b in went.values())
    lengths = sorted(len(ids) for ids in res["prompt_ids"])
    assert steps[1] - steps[0] == lengths[1] - lengths[0]
    (spot,) = [s for s in eng.same_spots if s.by == "position"]
    assert spot.value == BAD_POSITION and sorted(spot.requests) == sorted(went)
    assert "position- or length-dependent cause" in spot.line
