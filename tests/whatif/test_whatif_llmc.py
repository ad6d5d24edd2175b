"""llmcompressor's GPTQ on the real SmolLM2, run by `qforensics.whatif.llmc.calibrate` in the llmc
venv (scripts/install-llmc.sh; $QF_LLMC_PYTHON or .venv-llmc: without it these tests fail).

To stay within minutes on two cores, GPTQ quantizes the seven Linears of decoder block 0 only
(every other Linear is passed as ``ignore``); the calibration data is the package's calibration
text (not the evaluation text), 16 windows of 128 tokens at most.

Expectations come from definitions, not from the tool:
- the checkpoint is compressed-tensors' pack-quantized layout for W4A16 with group 64
  (int32 words of eight 4-bit values along the input dim, value + 8 stored unsigned;
  ``weight_scale`` per group of 64 inputs), every other Linear left as a plain float weight;
- the weights lie on the grid: the unpacked integers lie in [-8, 7], and the weights the HF
  path runs on (the checkpoint loaded by transformers + compressed-tensors here) are exactly
  those integers times the group's scale;
- GPTQ minimises, layer by layer, the output error on the calibration inputs,
  ||(W - Q) X||^2 with X the inputs the unquantized layer sees (block 0: the float model's own,
  nothing before it is quantized). Round-to-nearest with min/max scales (scale = absmax / 7.5,
  round, clamp to [-8, 7], written out here) is one point of the same search space, so GPTQ must
  do no worse on that objective, Linear by Linear.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from qforensics.whatif.llmc import (
    calibrate,
    calibration_text,
    load_llmc_model,
    resolve_llmc_python,
)
from qforensics.whatif.run import reference_text
from qforensics.whatif.schemes import parse_whatif_scheme

pytestmark = [pytest.mark.llmc, pytest.mark.model]

GROUP, SAMPLES, SEQ = 64, 16, 128
BLOCK = "model.layers.0."


@pytest.fixture(scope="module")
def gptq(demo, tmp_path_factory):
    model, tok = demo
    py = resolve_llmc_python(None)  # fails with how to build the venv when it is missing
    others = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)
              and not n.startswith(BLOCK) and not n.endswith("lm_head")]
    sc = parse_whatif_scheme(f"llmc:GPTQ-W4A16-g{GROUP}")
    lines: list[str] = []
    folder, info = calibrate(model, tok, sc, py, samples=SAMPLES, seq_len=SEQ, ignore=others,
                             cache=tmp_path_factory.mktemp("llmc-cache"), say=lines.append)
    return folder, info, lines, others


def _unpack4(words: torch.Tensor, k: int) -> torch.Tensor:
    """[N, K/8] int32 words -> [N, K] ints: value i of a word at bits 4i..4i+3, stored + 8."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    nib = torch.stack([(w >> (4 * i)) & 0xF for i in range(8)], dim=-1)
    return (nib.reshape(words.shape[0], -1)[:, :k] - 8).to(torch.int64)


def _block0_inputs(model, tok) -> dict[str, torch.Tensor]:
    """The inputs each block-0 Linear sees on the calibration windows, [tokens, in]."""
    ids = tok(calibration_text())["input_ids"]
    wins = [ids[i:i + SEQ] for i in range(0, len(ids) - SEQ + 1, SEQ)][:SAMPLES]
    assert len(wins) >= 8, len(wins)
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = [m.register_forward_pre_hook(
        lambda mod, args, name=n: seen.setdefault(name, []).append(
            args[0].detach().reshape(-1, args[0].shape[-1]).double()))
        for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith(BLOCK)]
    try:
        with torch.inference_mode():
            for w in wins:
                model(torch.tensor([w]))
    finally:
        for h in hooks:
            h.remove()
    return {n: torch.cat(v) for n, v in seen.items()}


def test_calibration_text_is_not_the_evaluation_text():
    cal, ev = calibration_text(), reference_text()
    assert len(cal.split()) > 1000
    cal_lines = {ln.strip() for ln in cal.splitlines() if len(ln.strip()) > 40}
    assert not cal_lines & {ln.strip() for ln in ev.splitlines()}


def test_gptq_checkpoint_is_compressed_tensors_w4a16_g64(gptq, demo):
    folder, info, lines, others = gptq
    model, _ = demo
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized", qc
    (group,) = qc["config_groups"].values()
    w = group["weights"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["group_size"]) == \
        (4, "int", True, "group", GROUP), w
    assert group.get("input_activations") is None
    assert "lm_head" in qc["ignore"] and set(others) <= set(qc["ignore"])
    assert info["modifiers"] == ["GPTQModifier"]
    assert info["calibration"]["file"] == "calibration.txt"
    assert info["calibration"]["samples"] <= SAMPLES and info["calibration"]["seq_len"] == SEQ
    assert any("GPTQModifier" in ln for ln in lines), lines  # progress came through

    sd = load_file(str(folder / "model.safetensors"))
    block0 = {n: m for n, m in model.named_modules()
              if isinstance(m, nn.Linear) and n.startswith(BLOCK)}
    assert len(block0) == 7
    for name, mod in block0.items():
        n, k = mod.weight.shape
        assert f"{name}.weight" not in sd
        assert sd[f"{name}.weight_packed"].dtype == torch.int32
        assert tuple(sd[f"{name}.weight_packed"].shape) == (n, k // 8)
        assert tuple(sd[f"{name}.weight_scale"].shape) == (n, k // GROUP)
    for name in others[:20]:  # left alone: the original float weights
        assert torch.equal(sd[f"{name}.weight"].float(),
                           dict(model.named_parameters())[f"{name}.weight"].detach().float())


@pytest.fixture(scope="module")
def on_grid(gptq, demo):
    """{Linear: (integers, scale [N, K/G], the weight the HF path runs on)} of block 0."""
    folder, *_ = gptq
    sd = load_file(str(folder / "model.safetensors"))
    hf = load_llmc_model(folder)
    with torch.inference_mode():  # the first forward decompresses
        hf(torch.tensor([[1, 2, 3]]))
    out = {}
    for name, mod in hf.named_modules():
        if not name.startswith(BLOCK) or not isinstance(mod, nn.Linear):
            continue
        k = int(sd[f"{name}.weight_shape"][1])
        ints = _unpack4(sd[f"{name}.weight_packed"], k)
        out[name] = (ints, sd[f"{name}.weight_scale"].double(), mod.weight.detach().double())
    return out


def test_gptq_weights_lie_on_the_w4_grid(on_grid):
    assert len(on_grid) == 7
    for name, (ints, scale, weight) in on_grid.items():
        assert int(ints.min()) >= -8 and int(ints.max()) <= 7, name
        assert len(torch.unique(ints)) > 8, name  # the whole range is used, not a stuck value
        deq = ints.double() * scale.repeat_interleave(GROUP, dim=1)
        torch.testing.assert_close(weight, deq, rtol=0, atol=1e-6 * float(scale.max()))


def _rtn(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    wg = w.reshape(n, k // GROUP, GROUP)
    scale = wg.abs().amax(2, keepdim=True) / 7.5
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.clamp(torch.round(wg / scale), -8, 7) * scale).reshape(n, k)


def test_gptq_beats_minmax_rounding_on_the_calibration_objective(on_grid, demo):
    model, tok = demo
    xs = _block0_inputs(model, tok)
    weights = dict(model.named_parameters())
    for name, (_, _, q) in on_grid.items():
        w = weights[f"{name}.weight"].detach().double()
        x = xs[name]
        err_gptq = float(((w - q) @ x.T).pow(2).sum())
        err_rtn = float(((w - _rtn(w)) @ x.T).pow(2).sum())
        assert err_gptq <= err_rtn, (name, err_gptq, err_rtn)


def test_a_failed_calibration_is_reported_with_its_reason(demo, tmp_path):
    from qforensics.whatif.llmc import LlmcError

    model, tok = demo
    sc = parse_whatif_scheme("llmc:GPTQ-W4A16-g64")
    with pytest.raises(LlmcError, match=r"llmcompressor failed \(exit 3\): ValueError: .*"
                                        r"fewer than one window of 128"):
        calibrate(model, tok, sc, resolve_llmc_python(None), calib_text="far too short",
                  cache=tmp_path)
    assert not any(tmp_path.iterdir())  # nothing cached
