"""`diff` between an HF trace and a vLLM trace of the same prompt lines up: vLLM's fused
qkv_proj / gate_up_proj inputs stand for HF's q/k/v and gate/up inputs. Both runs are real
(transformers' LlamaForCausalLM and vLLM's engine, both bfloat16); the expectation is that the
same activations agree closely, which the HF model's own plain hooks could tell, not a figure
read from either trace."""

from __future__ import annotations

import pytest
import torch

from qforensics.analyze.diff import diff_traces
from vllm_runs import PROMPT_A, run_recorded

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def pair(tmp_path_factory, bf16_model_dir, tokenizer):
    import qforensics
    from qforensics.demo.model import load_model

    tmp = tmp_path_factory.mktemp("diff")
    vrun = run_recorded(tmp, bf16_model_dir, [PROMPT_A], 2)
    model, _ = load_model("bfloat16")
    ids = torch.tensor([tokenizer(PROMPT_A)["input_ids"]])
    with torch.no_grad(), qforensics.capture(model, tmp / "hf.h5"):
        model(input_ids=ids)
    return tmp / "hf.h5", vrun["files"][0]


def test_fused_inputs_align_with_the_hf_layers(pair):
    from qforensics.analyze.engine import hf_aligned_records
    from qforensics.trace.reader import open_trace

    hf, vl = pair
    d = diff_traces(hf, vl)
    assert d.steps_compared == [0]
    # per layer: q/k/v and gate/up inputs (5) + o_proj and down_proj input and output (4)
    assert d.n_aligned >= 30 * 9
    with open_trace(hf) as h, open_trace(vl) as v:
        a = h.records(0)
        b = hf_aligned_records(v, v.records(0))
    key = ["module", "io", "slot"]
    m = a.merge(b, on=key, suffixes=("_hf", "_vllm"))
    for layer in range(30):
        for leaf in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "mlp.gate_proj", "mlp.up_proj"):
            assert len(m[(m["module"] == f"model.layers.{layer}.{leaf}") & (m["io"] == 0)]) == 1
    # the same activation in two bf16 engines: layer 0's attention input agrees closely
    row = m[(m["module"] == "model.layers.0.self_attn.q_proj") & (m["io"] == 0)].iloc[0]
    assert row["rows_hf"] == row["rows_vllm"] == len(h_ids(pair))
    assert abs(row["std_vllm"] - row["std_hf"]) <= 0.02 * row["std_hf"]
    assert abs(row["absmax_vllm"] - row["absmax_hf"]) <= 0.05 * row["absmax_hf"]


def h_ids(pair):
    from qforensics.trace.reader import open_trace

    with open_trace(pair[0]) as t:
        return t.input_ids(0)
