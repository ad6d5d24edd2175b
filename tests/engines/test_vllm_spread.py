"""A true spread in the real vLLM engine, beside the rotary case of test_vllm_ring.py: a request
that goes bad at a position no request went bad at, in a forward where another one is already
bad, is read as possibly spread from it (issue 42, item 5).

The construction: the embedding row of one rare word is NaN (lm_head untied, so the logits of
other requests stay finite: qforensics/demo/vllm_incident.py). Request A's prompt holds the word
inside a long shared prefix; A goes bad at the word's position in its prefill and keeps
decoding, its KV cache NaN from there on. Request B has the same prefix and another ending,
added once A decodes: with prefix caching, B reuses A's cached prefix blocks and computes only
from the first position past them, where its attention reads A's NaN keys. So B goes bad at
that position (a multiple of the block size, after the word), first in an attention's output,
in a forward where A is already bad. Everything expected comes from that construction and the
engine's block size, never from qforensics' own output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qforensics.demo import vllm_incident as vi

pytestmark = pytest.mark.vllm

SERVE = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main():
    from vllm import LLM, SamplingParams

    model_dir, prefix, end_a, end_b, out = sys.argv[1:6]
    llm = LLM(model=model_dir, dtype="bfloat16", enforce_eager=True, max_model_len=1024,
              seed=0, enable_prefix_caching=True)
    eng = llm.llm_engine
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    eng.add_request("A", prefix + end_a, params)
    for _ in range(4):  # A's prefill, then decode steps: A is bad and still running
        eng.step()
    eng.add_request("B", prefix + end_b, params)
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = {"prompt": list(o.prompt_token_ids),
                                      "tokens": list(o.outputs[0].token_ids)}
    block = int(llm.llm_engine.vllm_config.cache_config.block_size)
    with open(out, "w") as f:
        json.dump({"block": block, "done": done}, f)


if __name__ == "__main__":
    main()
"""


@pytest.fixture(scope="module")
def spread_run(tmp_path_factory, bf16_model_dir, tokenizer) -> dict:
    tmp = tmp_path_factory.mktemp("vllm-spread")
    word = vi.incident_checkpoint(bf16_model_dir, tmp / "model")
    text = " ".join(vi.healthy_texts()[:6])
    words = text.split()
    # the rare word early, the prefix long enough to fill several KV blocks of any CPU size
    prefix = " ".join(words[:4]) + vi.RARE_WORD + " " + " ".join(words[4:260])
    script = tmp / "serve_spread.py"
    script.write_text(SERVE)
    out = tmp / "out.json"
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [repo] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    proc = subprocess.run(
        [sys.executable, "-c", "from qforensics.cli import main; main()", "record", "-o",
         str(tmp / "t-{rank}.h5"), "--", sys.executable, str(script), str(tmp / "model"),
         prefix, " Tell me more about that.", " Now write a short poem about the sea.",
         str(out)],
        env=env, capture_output=True, text=True, timeout=900, cwd=tmp, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"out": json.loads(out.read_text()), "trace": tmp / "t-0.h5", "word": word}


def test_b_reading_as_cached_prefix_is_a_spread_at_its_own_position(spread_run):
    from qforensics.analyze.analyzer import analyze_trace

    res = spread_run["out"]
    block, a, b = res["block"], res["done"]["A"], res["done"]["B"]
    word_pos = a["prompt"].index(spread_run["word"])
    common = next(i for i, (x, y) in enumerate(zip(a["prompt"], b["prompt"])) if x != y)
    cached = (common // block) * block  # B's first computed position: past A's full blocks
    assert word_pos < cached, (word_pos, cached, block)  # the prefix holds the word, cached
    f = analyze_trace(spread_run["trace"])
    went = {x.request_id: x for x in f.engine.went_bad}
    assert len(went) == 2, [x.line for x in f.engine.went_bad]
    ra, rb = sorted(went.values(), key=lambda x: x.step)
    assert (ra.position, ra.kind, ra.phase) == (word_pos, "independent", "prefill"), ra.line
    assert ra.token == spread_run["word"]
    assert rb.position == cached and rb.phase == "prefill", rb.line
    assert rb.first_module.endswith(".self_attn.o_proj"), rb.line  # its attention read NaN
    assert rb.kind == "possibly_spread" and rb.spread_from == [ra.request_id], rb.line
    assert not f.engine.same_spots
