"""HF and vLLM module names aligned, the rank files of one run, prompt-length buckets."""

from __future__ import annotations

from qforensics.triage.names import align_producer, producer_site, run_key
from qforensics.triage.summary import prompt_bucket


def test_fused_vllm_layers_read_in_hf_spelling():
    assert align_producer("model.layers.3.self_attn.qkv_proj") == \
        "model.layers.3.self_attn.q_proj+k_proj+v_proj"
    assert align_producer("model.layers.0.mlp.gate_up_proj") == \
        "model.layers.0.mlp.gate_proj+up_proj"
    assert align_producer("model.layers.3.self_attn.o_proj") == "model.layers.3.self_attn.o_proj"
    # the engine's own map wins; an untrusted map of non-strings is ignored
    hf = {"m.l.1.attn.qkv_proj": ["m.l.1.attn.wq", "m.l.1.attn.wk", "m.l.1.attn.wv"]}
    assert align_producer("m.l.1.attn.qkv_proj", hf) == "m.l.1.attn.wq+wk+wv"
    assert align_producer("x.qkv_proj", {"x.qkv_proj": [1, 2]}) == "x.q_proj+k_proj+v_proj"


def test_hf_and_vllm_meet_at_one_site():
    for name in ("model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.v_proj",
                 "model.layers.3.self_attn.q_proj+k_proj+v_proj"):
        assert producer_site(name) == "model.layers.3.self_attn.qkv_proj"
    assert producer_site("model.layers.9.mlp.up_proj") == "model.layers.9.mlp.gate_up_proj"
    assert producer_site("model.layers.9.mlp.down_proj") == "model.layers.9.mlp.down_proj"


def test_rank_files_of_one_run_share_a_key(tmp_path):
    a = run_key(str(tmp_path / "serve-0.h5"), 0, 2)
    b = run_key(str(tmp_path / "serve-1.h5"), 1, 2)
    assert a == b
    assert run_key(str(tmp_path / "job12.rank1.h5"), 1, 4) == \
        run_key(str(tmp_path / "job12.rank3.h5"), 3, 4)
    assert run_key(str(tmp_path / "job12.rank1.h5"), 1, 4) != \
        run_key(str(tmp_path / "job13.rank1.h5"), 1, 4)
    assert run_key(str(tmp_path / "serve-0.h5"), 0, 2) != \
        run_key(str(tmp_path / "other" / "serve-1.h5"), 1, 2)
    # single-rank traces are runs of their own
    assert run_key(str(tmp_path / "a-0.h5"), 0, 1) != run_key(str(tmp_path / "a-1.h5"), 0, 1)


def test_prompt_buckets():
    assert [prompt_bucket(n) for n in (1, 16, 17, 64, 65, 600, 1024, 5000, 99999, 0)] == [
        "1-16", "1-16", "17-64", "17-64", "65-256", "257-1024", "257-1024", "4097-16384",
        ">16384", "unknown"]
