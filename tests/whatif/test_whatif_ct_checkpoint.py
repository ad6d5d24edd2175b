"""The ct: checkpoint writer (qforensics.whatif.ct_checkpoint) on the real SmolLM2: the folder
holds compressed-tensors' published layout for the preset, and the library's own decompression
of what was written gives back the weights the HF library figure runs on.

Expectations come from the format's definition, not from the writer: which Linears a preset
takes (every Linear but lm_head whose in_features the group divides), the tensor names, dtypes
and shapes each compression format stores (pack-quantized: ``weight_packed`` int32 with
32 / num_bits values per word along the input dim, ``weight_shape``, ``weight_scale`` per
group, packed ``weight_zero_point`` when asymmetric; int-quantized: int8 ``weight``;
float-quantized: float8_e4m3fn ``weight``; per-channel scales [N, 1]), and symmetric INT
quantization written out by hand (scale = absmax / ((2^b - 1) / 2), round, clamp)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from qforensics.whatif.ct_checkpoint import ct_compressed, write_ct_checkpoint
from qforensics.whatif.library import (
    applied_compressed_tensors,
    check_compressed_tensors_preset,
)
from qforensics.whatif.checkpoints import base_state


def _expected_linears(model, group: int | None) -> dict[str, tuple[int, int]]:
    """{name: (out, in)} of the Linears a preset takes: all but lm_head, in % group == 0."""
    return {n: tuple(m.weight.shape) for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and not n.endswith("lm_head")
            and (group is None or m.in_features % group == 0)}


def _sym_int(w: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Symmetric INT fake-quant per group of ``group`` inputs (min/max including zero)."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    absmax = torch.maximum(wg.amin(2, keepdim=True).abs(), wg.amax(2, keepdim=True).abs())
    scale = absmax / ((2 ** bits - 1) / 2)
    q = torch.clamp(torch.round(wg / scale), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return (q * scale).reshape(n, k)


def _library_weights(model, preset: str, names: list[str]) -> dict[str, torch.Tensor]:
    """The weights the library's own quantized forward multiplies by (the HF figure's path):
    its ``forward_quantize`` on the weight, the call its wrapped forward makes."""
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    mods = dict(model.named_modules())
    out = {}
    with torch.no_grad(), applied_compressed_tensors(model, preset):
        for n in names:
            m = mods[n]
            out[n] = forward_quantize(m, m.weight.data, "weight",
                                      m.quantization_scheme.weights).float().clone()
    return out


def _decompress(tensors: dict[str, torch.Tensor], name: str, preset: str, fmt: str):
    from compressed_tensors.compressors import BaseCompressor

    local = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
    return BaseCompressor.get_value_from_registry(fmt).decompress(
        local, check_compressed_tensors_preset(preset))["weight"]


def test_w4a16_g64_folder_has_the_published_layout_and_decompresses_to_the_hf_weights(
        tmp_path, demo):
    from safetensors.torch import load_file

    model, tok = demo
    scheme = check_compressed_tensors_preset("W4A16-g64")
    bits, group = scheme.weights.num_bits, scheme.weights.group_size
    assert (bits, group) == (4, 64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    base = base_state(model)
    folder, n = write_ct_checkpoint(model, tok, "W4A16-g64", base, tmp_path / "ct")
    want = _expected_linears(model, group)
    assert n == len(want) == 7 * model.config.num_hidden_layers  # q k v o gate up down
    # the live model is untouched
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())

    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["quantization_status"] == "compressed"
    (grp,) = qc["config_groups"].values()
    assert grp["weights"]["num_bits"] == 4 and grp["weights"]["group_size"] == 64
    assert grp["weights"]["symmetric"] is True and grp["weights"]["strategy"] == "group"
    assert grp["input_activations"] is None and "lm_head" in qc["ignore"]

    sd = load_file(str(folder / "model.safetensors"))
    for name, (out_f, in_f) in want.items():
        assert f"{name}.weight" not in sd and f"{name}.weight_zero_point" not in sd
        assert sd[f"{name}.weight_packed"].dtype == torch.int32
        assert sd[f"{name}.weight_packed"].shape == (out_f, in_f * bits // 32)
        assert sd[f"{name}.weight_scale"].shape == (out_f, in_f // group)
        assert sd[f"{name}.weight_shape"].tolist() == [out_f, in_f]
    # everything else is the bfloat16 reference state, unchanged
    rest = {k: v for k, v in base[0].items() if k.rsplit(".", 1)[0] not in want}
    assert rest and all(torch.equal(sd[k], v) and v.dtype == torch.bfloat16
                        for k, v in rest.items())
    assert set(sd) == set(rest) | {f"{n}.{t}" for n in want
                                   for t in ("weight_packed", "weight_scale", "weight_shape")}

    names = [n for n in want if ".layers.0." in n or ".layers.29." in n]
    lib = _library_weights(model, "W4A16-g64", names)
    mods = dict(model.named_modules())
    for name in names:
        got = _decompress(sd, name, "W4A16-g64", "pack-quantized").float()
        torch.testing.assert_close(got, lib[name], rtol=0, atol=0)
        hand = _sym_int(mods[name].weight.detach(), bits, group)
        torch.testing.assert_close(got, hand, rtol=1e-6, atol=1e-7)
        assert not torch.equal(got, mods[name].weight)  # really quantized


@pytest.mark.parametrize("preset, fmt", [("W4A16_ASYM", "pack-quantized"),
                                         ("W8A8", "int-quantized"),
                                         ("FP8_DYNAMIC", "float-quantized")])
def test_other_presets_have_their_formats_layout(demo, preset, fmt):
    model, _ = demo
    scheme = check_compressed_tensors_preset(preset)
    w = scheme.weights
    group = w.group_size if str(getattr(w.strategy, "value", w.strategy)) == "group" else None
    tensors, mc, n = ct_compressed(model, preset)
    want = _expected_linears(model, group)
    assert n == len(want) and want
    assert mc.quantization_config.format == fmt
    for name, (out_f, in_f) in want.items():
        keys = {k[len(name) + 1:] for k in tensors if k.startswith(name + ".")}
        if fmt == "pack-quantized":  # asymmetric INT4: zero points packed along the outputs
            assert keys == {"weight_packed", "weight_scale", "weight_shape",
                            "weight_zero_point"}
            assert tensors[f"{name}.weight_packed"].shape == (out_f, in_f * w.num_bits // 32)
            assert tensors[f"{name}.weight_zero_point"].dtype == torch.int32
            assert tensors[f"{name}.weight_zero_point"].shape == (
                out_f * w.num_bits // 32, in_f // group)
            assert tensors[f"{name}.weight_scale"].shape == (out_f, in_f // group)
        else:  # per output channel: one scale per row, the weight stored at 8 bits
            assert keys == {"weight", "weight_scale"}
            assert tensors[f"{name}.weight"].dtype == (
                torch.int8 if fmt == "int-quantized" else torch.float8_e4m3fn)
            assert tensors[f"{name}.weight"].shape == (out_f, in_f)
            assert tensors[f"{name}.weight_scale"].shape == (out_f, 1)
    names = [n for n in want if ".layers.3." in n][:3]
    lib = _library_weights(model, preset, names)
    for name in names:
        got = _decompress(tensors, name, preset, fmt).float()
        torch.testing.assert_close(got, lib[name], rtol=0, atol=0)
    if preset == "W8A8":  # symmetric int8 per channel, by hand
        mods = dict(model.named_modules())
        for name in names:
            wt = mods[name].weight.detach()
            torch.testing.assert_close(lib[name], _sym_int(wt, 8, wt.shape[1]),
                                       rtol=1e-6, atol=1e-7)


# -- a mixed recipe: W4A16 g64 for the MLPs, W8A8 for attention, one Linear kept in bf16 ----------
MIXED = "mlp=W4A16-g64,attn=W8A8,keep=model.layers.11.mlp.down_proj"


def test_mixed_recipe_writes_one_config_group_per_part_and_keeps_the_ignored_linear(
        tmp_path, demo):
    from safetensors.torch import load_file

    model, tok = demo
    layers = model.config.num_hidden_layers
    lin = _expected_linears(model, None)
    # by the recipe's words: "mlp" / "attn" in a name component above the Linear's own
    mlp = {n for n in lin if ".mlp." in n} - {"model.layers.11.mlp.down_proj"}
    attn = {n for n in lin if ".self_attn." in n}
    assert len(mlp) == 3 * layers - 1 and len(attn) == 4 * layers
    folder, n = write_ct_checkpoint(model, tok, MIXED, base_state(model), tmp_path / "mixed")
    assert n == len(mlp) + len(attn)
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    groups = list(qc["config_groups"].values())
    assert len(groups) == 2
    by_bits = {g["weights"]["num_bits"]: g for g in groups}
    w4, w8 = by_bits[4], by_bits[8]
    assert w4["format"] == "pack-quantized" and w4["weights"]["group_size"] == 64
    assert w4["input_activations"] is None
    assert w8["format"] == "int-quantized" and w8["input_activations"]["num_bits"] == 8
    assert w8["input_activations"]["dynamic"] is True
    # the kept Linear is in the library's ignore list, with lm_head
    assert "model.layers.11.mlp.down_proj" in qc["ignore"] and "lm_head" in qc["ignore"]
    sd = load_file(str(folder / "model.safetensors"))
    for name in mlp:
        assert f"{name}.weight_packed" in sd and f"{name}.weight" not in sd
    for name in attn:
        assert sd[f"{name}.weight"].dtype == torch.int8
    kept = sd["model.layers.11.mlp.down_proj.weight"]
    assert kept.dtype == torch.bfloat16
    assert torch.equal(kept, dict(model.named_modules())[
        "model.layers.11.mlp.down_proj"].weight.detach().to(torch.bfloat16))


@pytest.mark.parametrize("recipe, words", [
    ("mlp=W4A16,mlp=W8A8", "given twice"),
    ("mlp=W4A16,keep=model.layers.99.mlp.down_proj", "is not a Linear"),
    ("layers=W4A16,mlp=W8A8", "in two parts"),  # model.layers.N.mlp.*: both keys above
    ("nothing=W4A16", "takes no Linear"),
])
def test_a_recipe_that_cannot_hold_is_refused_with_its_reason(demo, recipe, words):
    from qforensics.errors import UsageError

    model, _ = demo
    with pytest.raises(UsageError, match=words):
        with applied_compressed_tensors(model, recipe):
            pass
    assert not any(hasattr(m, "quantization_scheme") for m in model.modules())
