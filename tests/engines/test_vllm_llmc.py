"""llmcompressor's GPTQ checkpoint of the real SmolLM2 served by vLLM (``llmc:`` schemes,
`qforensics.whatif.llmc` + `qforensics.whatif.through_vllm`): the very folder llmcompressor wrote
loads on vLLM's compressed-tensors method, and vLLM's perplexity matches the HF figure of the
same checkpoint measured here.

Runs in vLLM's venv, calibrating in llmcompressor's ($QF_LLMC_PYTHON or .venv-llmc: without it
the test fails). To stay within minutes, GPTQ quantizes decoder blocks 0-1 only (the rest is
passed as ``ignore``), and no speed rounds are run (test_vllm_whatif_ct times the same kernel).

Expectations: vLLM's Llama fuses q/k/v into one linear layer and gate/up into another, so each
quantized decoder block is 4 linear layers for vLLM (qkv, o, gate_up, down), all on
compressed-tensors' WNA16 scheme (4-bit weights, 16-bit activations; the W4A16 kernel with
VLLM_CPU_INT4_W4A8=0). The same quantized weights through two engines give close perplexities:
HF runs float32, vLLM bfloat16; the ct: test bounds that gap by 5% (the awq: test sees both
references within 1%), and the same bound holds here.
"""

from __future__ import annotations

import sys

import pytest
from torch import nn

pytestmark = [pytest.mark.vllm, pytest.mark.llmc, pytest.mark.w4a16]  # GPTQ W4A16

BLOCKS = 2


def test_llmc_gptq_checkpoint_is_served_by_vllm_next_to_hf(tmp_path, monkeypatch):
    from qforensics.whatif.llmc import calibrate, resolve_llmc_python
    from qforensics.whatif.run import WhatIf, demo_prompt_ids, load_demo
    from qforensics.whatif.schemes import parse_whatif_scheme
    from qforensics.whatif.through_vllm import measure_through_vllm

    py = resolve_llmc_python(None)
    model, tok = load_demo()
    keep = tuple(f"model.layers.{i}." for i in range(BLOCKS))
    ignore = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)
              and not n.startswith(keep) and not n.endswith("lm_head")]
    sc = parse_whatif_scheme("llmc:GPTQ-W4A16-g64")
    folder, info = calibrate(model, tok, sc, py, ignore=ignore, cache=tmp_path / "cache")
    assert info["modifiers"] == ["GPTQModifier"]

    wi = WhatIf(model, tok, demo_prompt_ids(tok), max_new_tokens=8, text_tokens=256)
    wi.llmc_folders = {sc.label: folder}
    hf = wi.measure(sc)
    assert 0 < hf.recovered < 1.0 and not hf.nonfinite

    monkeypatch.setenv("VLLM_CPU_INT4_W4A8", "0")
    figs = measure_through_vllm(model, tok, [sc], wi.text_ids[0].tolist(),
                                wi.ref_full[0].tolist(), wi.n_prompt, python=sys.executable,
                                prebuilt={sc.label: folder}, plan=None)
    v = figs[sc.label]
    assert "error" not in v, v
    eng = v["engine"]
    assert eng["schemes"] == {"CompressedTensorsWNA16": 4 * BLOCKS}, eng
    assert eng["quant_methods"].get("CompressedTensorsLinearMethod", 0) >= 4 * BLOCKS, eng
    assert eng["use_w4a8"] == [False], eng
    assert folder.is_dir()  # served as it is, and left to its owner (the cache)
    assert v["text_positions"] == 255 and not v["nonfinite"]
    assert abs(v["ppl"] - hf.ppl) / hf.ppl < 0.05, (v["ppl"], hf.ppl)
    assert abs(v["ref_ppl"] - wi.ref_ppl) / wi.ref_ppl < 0.05, (v["ref_ppl"], wi.ref_ppl)
