"""`qforensics whatif --engine vllm --scheme awq:w4a16-g64` on the demo trace: the AWQ checkpoint
is served by vLLM's own AWQ kernel (W4A16: VLLM_CPU_INT4_W4A8=0) and its figures stand next to
the HF fake-quant ones. Both paths quantize to the same weights, so their perplexities must be
close; the unquantized bfloat16 run in vLLM and the float32 HF model hold the same weights up
to bfloat16 rounding, so their reference perplexities must be close too."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.w4a16]  # awq: through vLLM's AWQ kernel


@pytest.fixture(scope="module")
def result(whatif_vllm):
    return whatif_vllm  # the session's one what-if run through vLLM (conftest.py)


def test_awq_is_measured_through_vllms_awq_kernel_next_to_hf(result):
    by = {s["scheme"]: s for s in result["json"]["schemes"]}
    awq, int4 = by["awq:w4a16-g64"], by["w:int4-g64"]
    v = awq["vllm"]
    assert awq["scheme"] == "awq:w4a16-g64" and awq["path"].startswith("HF fake-quant")
    assert "AWQ" in v["path"] and "W4A16" in v["path"], v["path"]
    assert v["engine"]["use_w4a8"] == [False]
    assert v["text_positions"] == 255 and not v["nonfinite"]
    # the same quantized weights through two paths: close perplexities
    assert abs(v["ppl"] - awq["ppl"]) / awq["ppl"] < 0.05, (v["ppl"], awq["ppl"])
    ref_hf = result["json"]["reference"]["ppl"]
    assert abs(v["ref_ppl"] - ref_hf) / ref_hf < 0.05, (v["ref_ppl"], ref_hf)
    assert v["recovered"] == pytest.approx(v["ref_ppl"] / v["ppl"])
    # the project's own fake-quant scheme has no vLLM kernel: said, not measured
    assert "skipped" in int4["vllm"]


def test_the_output_says_which_path_made_each_figure(result):
    out = result["stdout"]
    assert "these figures: HF fake-quant" in out and "scheme (through vLLM)" in out
    assert "CPU kernel W4A16" in out
    assert "(vLLM)" in result["stderr"] and "one engine start" in result["stderr"]
