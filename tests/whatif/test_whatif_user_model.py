"""`whatif --model`: the user's own model (an HF folder, module:factory; the recorded path by
default), refused with exit 2 when it is not the model the trace was recorded from.

The user models are small Llama / Mistral models built from configs (random weights) and saved
with save_pretrained, with the demo model's real tokenizer beside them; the traces are real
captures of them."""

from __future__ import annotations

import textwrap

import pytest
import torch
from click.testing import CliRunner

import qforensics
from qforensics.cli import main
from qforensics.errors import UsageError
from qforensics.whatif.model import describe_mismatch, resolve_model_source

PROMPT = "What is the capital of France?"


def _save(tmp_path, demo, arch="llama", layers=2, name="user-model"):
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    _, tok = demo
    cfg_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (
        MistralConfig, MistralForCausalLM)
    cfg = cfg_cls(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = model_cls(cfg).eval()
    folder = tmp_path / name
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _trace_of(folder, tmp_path, demo):
    from transformers import AutoModelForCausalLM

    _, tok = demo
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    path = tmp_path / f"{folder.name}.h5"
    with torch.no_grad(), qforensics.capture(model, path):
        model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    return path


def test_the_recorded_folder_is_the_default_and_runs(tmp_path, demo):
    folder = _save(tmp_path, demo)
    trace = _trace_of(folder, tmp_path, demo)
    with qforensics.open_trace(trace) as t:
        assert t.meta["environment"]["model_path"] == str(folder.resolve())
        assert t.meta["environment"]["vocab_size"] == len(demo[1])
    r = CliRunner().invoke(main, ["whatif", str(trace), "--scheme", "w:int4-g128",
                                  "--max-new-tokens", "4", "--text-tokens", "16"])
    assert r.exit_code == 0, r.output
    assert f"loading HF folder {folder.resolve()} (the trace's metadata)" in r.output
    assert "int4-g128" in r.output and "SmolLM2" not in r.output


def test_a_factory_runs(tmp_path, demo):
    folder = _save(tmp_path, demo)
    trace = _trace_of(folder, tmp_path, demo)
    factory = tmp_path / "build.py"
    factory.write_text(textwrap.dedent(f"""
        from transformers import AutoModelForCausalLM, AutoTokenizer
        def build():
            return (AutoModelForCausalLM.from_pretrained({str(folder)!r}),
                    AutoTokenizer.from_pretrained({str(folder)!r}))
    """))
    r = CliRunner().invoke(main, ["whatif", str(trace), "--model", f"{factory}:build",
                                  "--scheme", "act:fp8-e4m3", "--max-new-tokens", "4",
                                  "--text-tokens", "16"])
    assert r.exit_code == 0, r.output
    assert f"loading factory {factory}:build (--model)" in r.output


def test_a_model_that_does_not_match_the_trace_is_refused(tmp_path, demo):
    folder = _save(tmp_path, demo, layers=2)
    trace = _trace_of(folder, tmp_path, demo)
    other = _save(tmp_path, demo, arch="mistral", layers=3, name="other")
    r = CliRunner().invoke(main, ["whatif", str(trace), "--model", str(other),
                                  "--scheme", "w:int4-g128"])
    assert r.exit_code == 2, r.output
    assert "\nError: " in r.output and "Traceback" not in r.output
    assert "class: the trace is of LlamaForCausalLM, the model is MistralForCausalLM" in r.output


def test_the_demo_model_is_refused_for_another_models_trace(tmp_path, demo):
    """The bug this fixes: whatif used to run SmolLM2 on any trace."""
    from transformers import AutoModelForCausalLM

    folder = _save(tmp_path, demo, layers=2)
    trace = _trace_of(folder, tmp_path, demo)
    with qforensics.open_trace(trace) as t:
        diffs = describe_mismatch(t, demo[0])
    text = "; ".join(diffs)
    assert not any(d.startswith("class") for d in diffs)  # both are Llama
    assert "vocab" not in text  # same tokenizer
    assert "shapes:" in text and "model.layers.0.self_attn.q_proj.weight [32, 32] vs " \
        "[576, 576]" in text
    mine = AutoModelForCausalLM.from_pretrained(folder)
    with qforensics.open_trace(trace) as t:
        assert describe_mismatch(t, mine) == []
    r = CliRunner().invoke(main, ["whatif", str(trace), "--model", "demo",
                                  "--scheme", "w:int4-g128"])
    assert r.exit_code == 2 and "is not a trace of the demo model" in r.output


def test_fewer_layers_names_the_missing_modules(tmp_path, demo):
    from transformers import AutoModelForCausalLM

    big = _save(tmp_path, demo, layers=3, name="big")
    trace = _trace_of(big, tmp_path, demo)
    small = AutoModelForCausalLM.from_pretrained(_save(tmp_path, demo, layers=2, name="small"))
    with qforensics.open_trace(trace) as t:
        diffs = describe_mismatch(t, small)
    assert any(d.startswith("module names:") and "model.layers.2" in d for d in diffs)


def test_bad_model_specs_are_usage_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    cases = {str(tmp_path / "empty"): "has no config.json",
             str(tmp_path / "missing.gguf"): "no such GGUF file",
             str(tmp_path / "nothing"): "not an HF folder, a .gguf file or module:factory"}
    for spec, msg in cases.items():
        with pytest.raises(UsageError, match=msg):
            resolve_model_source(spec, {})
    with pytest.raises(UsageError, match=r"which is not here \(anymore\); pass --model"):
        resolve_model_source(None, {"environment": {"model_path": "/nowhere/model"}})
    with pytest.raises(UsageError, match="records no model path"):
        resolve_model_source(None, {"environment": {"model_class": "X"}})
    assert resolve_model_source("mypkg.models:build", {}).kind == "factory"


def test_cli_bad_model_exits_2_before_loading(tmp_path):
    trace = tmp_path / "t.h5"
    from torch import nn

    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with qforensics.capture(m, trace):
        m(torch.ones(1, 4))
    r = CliRunner().invoke(main, ["whatif", str(trace), "--model", str(tmp_path / "x.gguf"),
                                  "--scheme", "int4-g128"])
    assert r.exit_code == 2 and "no such GGUF file" in r.output
    r = CliRunner().invoke(main, ["whatif", str(trace), "--model", "nomod_xyz:build",
                                  "--scheme", "int4-g128"])
    assert r.exit_code == 2 and "cannot import nomod_xyz" in r.output


def test_a_gguf_file_is_loaded_and_checked(demo):
    """--model with a GGUF file: the demo's own GGUF resolves to its cached conversion, and the
    committed demo trace matches it."""
    from pathlib import Path

    from qforensics.demo.model import gguf_path
    from qforensics.whatif.model import load_model_source

    src = resolve_model_source(str(gguf_path()), {})
    assert (src.kind, src.origin) == ("gguf", "--model")
    model, tok = load_model_source(src)
    assert model is demo[0] and tok is demo[1]
    sample = Path(__file__).resolve().parents[2] / "sample_traces" / "fp16-reference.h5"
    with qforensics.open_trace(sample) as t:
        assert describe_mismatch(t, model) == []
