"""Weight memory of a scheme's checkpoint against bf16 (qforensics.whatif.memory).

The expected bytes are summed here from the tensors safetensors loads back (numel x element
size, floating tensors at most 2 bytes: served in bfloat16), and, for W4A16, derived from the
format itself (4 bits per weight packed in int32, one scale per group of 64 inputs)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from qforensics.errors import QForensicsError
from qforensics.whatif.memory import checkpoint_memory, served_weight_bytes
from qforensics.whatif.run import parse_whatif_scheme
from qforensics.whatif.checkpoints import base_state, write_checkpoint


def _sums(folder) -> tuple[int, int]:
    """(served, stored) bytes of every tensor in folder's safetensors files, loaded back."""
    served = stored = 0
    for f in folder.glob("*.safetensors"):
        for t in load_file(str(f)).values():
            size = t.element_size()
            stored += t.numel() * size
            served += t.numel() * (min(size, 2) if t.is_floating_point() else size)
    return served, stored


def test_served_bytes_count_floats_at_bf16_and_ints_as_stored(tmp_path) -> None:
    save_file({"a": torch.zeros(3, 5, dtype=torch.float32),
               "b": torch.zeros(7, dtype=torch.bfloat16),
               "packed": torch.zeros(4, 2, dtype=torch.int32),
               "fp8": torch.zeros(6, dtype=torch.float8_e4m3fn),
               "shape": torch.tensor([4, 16], dtype=torch.int64)},
              str(tmp_path / "model.safetensors"))
    save_file({"c": torch.zeros(2, 2, dtype=torch.float16)}, str(tmp_path / "more.safetensors"))
    got = served_weight_bytes(tmp_path)
    assert (got["weight_bytes"], got["stored_bytes"]) == _sums(tmp_path)
    # by hand: 15*2 + 7*2 + 8*4 + 6*1 + 2*8 + 4*2 served; the float32 tensor stores 15*4
    assert got["weight_bytes"] == 30 + 14 + 32 + 6 + 16 + 8 and got["tensors"] == 6
    assert got["stored_bytes"] == got["weight_bytes"] + 30


def test_no_checkpoint_or_a_bad_header_is_an_error(tmp_path) -> None:
    with pytest.raises(QForensicsError, match="no safetensors"):
        served_weight_bytes(tmp_path)
    (tmp_path / "x.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(QForensicsError, match="header"):
        served_weight_bytes(tmp_path)


class _Tok:
    def save_pretrained(self, path) -> None:  # the folder's tokenizer: not needed here
        pass


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def _linears(model) -> dict[str, tuple[int, int]]:
    return {n: tuple(m.weight.shape) for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and not n.endswith("lm_head")}


def test_w4a16_g64_ratio_matches_the_format_and_the_written_tensors(tiny, tmp_path) -> None:
    from qforensics.demo.vllm_model import save_model_folder as _save_folder

    base = base_state(tiny)
    ref_dir = _save_folder(tmp_path / "ref", base[0], dict(base[1]), _Tok())
    ref_served, _ = _sums(ref_dir)
    assert ref_served == 2 * sum(v.numel() for v in base[0].values())  # all bf16
    mem = checkpoint_memory(tiny, _Tok(), [parse_whatif_scheme("ct:W4A16-g64"),
                                           parse_whatif_scheme("awq:w4a16-g64"),
                                           parse_whatif_scheme("w:int4-g128")])
    assert set(mem) == {"ct:W4A16-g64", "awq:w4a16-g64"}  # w: has no checkpoint format
    lin = _linears(tiny)
    # W4A16 (symmetric, group 64), from the format: each Linear's bf16 weight (2 bytes a value)
    # becomes 4-bit values packed in int32 (1/2 byte), a 2-byte scale per 64 inputs and an
    # int64 [2] weight_shape
    want = ref_served + sum(-2 * n * k + n * k // 2 + 2 * n * (k // 64) + 16
                            for n, k in lin.values())
    ct = mem["ct:W4A16-g64"]
    assert ct["weight_bytes"] == want and ct["bf16_weight_bytes"] == ref_served
    assert ct["vs_bf16"] == pytest.approx(want / ref_served)
    for label in ("ct:W4A16-g64", "awq:w4a16-g64"):  # the tensors written, loaded back
        folder, _ = write_checkpoint(tiny, _Tok(), parse_whatif_scheme(label), base,
                                     tmp_path / label.replace(":", "-"))
        served, stored = _sums(folder)
        assert mem[label]["weight_bytes"] == served and mem[label]["stored_bytes"] == stored
        assert mem[label]["vs_bf16"] == pytest.approx(served / ref_served)
        assert 0 < mem[label]["vs_bf16"] < 0.5  # the Linears dominate this tiny model


def test_a_recipe_with_many_keeps_gets_a_checkpoint_folder(tiny, tmp_path) -> None:
    # a recipe keeping many Linears in bf16 has a label longer than a file name may be (255
    # bytes): its checkpoint is still written, and two such labels that differ only after
    # where a cut name would end get a folder each
    names = sorted(_linears(tiny))
    kept = [n for n in names if n != "model.layers.0.mlp.down_proj"]
    labels = ["ct:layers=W8A8," + ",".join(f"keep={n}" for n in keep)
              for keep in (kept, kept[:-1])]
    assert min(map(len, labels)) > 255
    base = base_state(tiny)
    folders = []
    for i, label in enumerate(labels):
        folder, said = write_checkpoint(tiny, _Tok(), parse_whatif_scheme(label), base,
                                        tmp_path / f"w{i}")
        assert len(folder.name) < 255 and list(folder.glob("*.safetensors"))
        # quantized: layer 0's down_proj, and in the second the Linear it no longer keeps
        assert said == {"hf_quantized_linears": 1 + i}
        folders.append(folder.name)
    assert folders[0] != folders[1]
    mem = checkpoint_memory(tiny, _Tok(), [parse_whatif_scheme(labels[0])])
    assert 0.5 < mem[labels[0]]["vs_bf16"] < 1.0  # one Linear of 14 at 8 bits
