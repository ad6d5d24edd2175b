"""Model application: weight quantization + restore, activation hooks, calibration absmax."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qforensics.quant import (
    QuantApplyError,
    collect_input_absmax,
    fake_quant_int,
    find_linears,
    quantize_activations,
    quantize_weights,
)


class Block(nn.Module):
    def __init__(self, d: int = 16, hidden: int = 40) -> None:
        super().__init__()
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down_proj(torch.relu(self.up_proj(x)))


class Tiny(nn.Module):
    """Embedding -> 2 blocks -> lm_head tied to the embedding, like SmolLM2."""

    def __init__(self, vocab: int = 50, d: int = 16) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([Block(d), Block(d)])
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.embed_tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(ids)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(h)


def _hook_count(model: nn.Module) -> int:
    return sum(
        len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()
    )


@pytest.fixture
def model() -> Tiny:
    torch.manual_seed(0)
    return Tiny().eval()


@pytest.fixture
def ids() -> torch.Tensor:
    return torch.randint(0, 50, (2, 7))


def test_find_linears_exclude_patterns(model: Tiny) -> None:
    names = [n for n, _ in find_linears(model)]
    assert names == [
        "layers.0.up_proj", "layers.0.down_proj", "layers.1.up_proj", "layers.1.down_proj",
        "lm_head",
    ]
    assert "lm_head" not in [n for n, _ in find_linears(model, ("lm_head",))]
    assert [n for n, _ in find_linears(model, ("*down_proj", "lm_head"))] == [
        "layers.0.up_proj", "layers.1.up_proj"]
    assert [n for n, _ in find_linears(model, ("up_proj", "down_proj"))] == ["lm_head"]


def test_quantize_weights_and_restore_bit_identical(model: Tiny, ids: torch.Tensor) -> None:
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ref_out = model(ids)
    w0 = model.layers[0].up_proj.weight
    backup = quantize_weights(model, "int4-per-channel")
    assert backup.modules == ("layers.0.up_proj", "layers.0.down_proj",
                              "layers.1.up_proj", "layers.1.down_proj")
    assert model.layers[0].up_proj.weight is w0  # in place
    assert torch.equal(w0, fake_quant_int(before["layers.0.up_proj.weight"], 4, "per-channel"))
    assert torch.equal(model.lm_head.weight, before["lm_head.weight"])  # excluded by default
    assert not torch.equal(model(ids), ref_out)
    backup.restore()
    backup.restore()  # idempotent
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(model(ids), ref_out)


def test_quantize_weights_context_manager_restores_on_exception(model: Tiny) -> None:
    before = model.layers[1].down_proj.weight.clone()
    with pytest.raises(RuntimeError):
        with quantize_weights(model, "int8-g32"):
            assert not torch.equal(model.layers[1].down_proj.weight, before)
            raise RuntimeError("boom")
    assert torch.equal(model.layers[1].down_proj.weight, before)


def test_tied_weight_quantized_once(model: Tiny) -> None:
    before = model.embed_tokens.weight.clone()
    with quantize_weights(model, "int4-per-tensor", exclude=()) as b:
        assert "lm_head" in b.modules
        assert torch.equal(model.embed_tokens.weight, fake_quant_int(before, 4, "per-tensor"))
    assert torch.equal(model.embed_tokens.weight, before)


def test_quantize_weights_errors(model: Tiny) -> None:
    with pytest.raises(QuantApplyError):
        quantize_weights(model, "int4-g32", exclude=("*",))
    with pytest.raises(QuantApplyError):
        quantize_weights(model, "int4-g32-salient1pct")  # no calibration stats
    with pytest.raises(QuantApplyError):
        quantize_weights(model, "int4-g32-salient1pct", act_absmax={})
    with pytest.raises(ValueError):
        quantize_weights(model, "int4-per-token")


def test_activation_hooks_removed_normal_and_exception(model: Tiny, ids: torch.Tensor) -> None:
    assert _hook_count(model) == 0
    with quantize_activations(model, "int8-per-token") as aq:
        assert _hook_count(model) == 5 and len(aq.modules) == 5
        model(ids)
    assert _hook_count(model) == 0
    with pytest.raises(ValueError, match="boom"):
        with quantize_activations(model, "fp8-e4m3"):
            raise ValueError("boom")
    assert _hook_count(model) == 0
    # a forward that raises inside the context
    ctx = quantize_activations(model, "fp8-e4m3")
    with pytest.raises(IndexError):
        with ctx:
            model(torch.tensor([[999]]))
    assert _hook_count(model) == 0
    # nesting stacks and unwinds; re-entering one active instance is refused
    with quantize_activations(model, "int8-per-tensor") as a:
        with quantize_activations(model, "fp8-e5m2", exclude=("lm_head",)):
            assert _hook_count(model) == 9
        with pytest.raises(QuantApplyError):
            a.__enter__()
        assert _hook_count(model) == 5
    assert _hook_count(model) == 0


def test_activation_quant_changes_inputs(model: Tiny, ids: torch.Tensor) -> None:
    seen: list[torch.Tensor] = []
    handle = model.layers[0].down_proj.register_forward_pre_hook(
        lambda m, a: seen.append(a[0].clone()))
    try:
        ref = model(ids)
        with quantize_activations(model, "int4-per-token"):
            out = model(ids)
    finally:
        handle.remove()
    # our hook was registered later, so the user's earlier hook saw the raw input
    assert not torch.equal(out, ref)
    assert torch.equal(model(ids), ref)  # back to normal


def test_nonsaturating_fp8_activations_give_nan(model: Tiny, ids: torch.Tensor) -> None:
    """The SmolLM2 scenario in miniature: an input channel of ~3000 into a down_proj."""
    with torch.no_grad():
        model.layers[1].up_proj.weight[7] = 0.0
        model.layers[1].up_proj.weight[7, 0] = 1.0  # hidden unit 7 = relu(h[..., 0])
        model.embed_tokens.weight[:, 0] = 3000.0  # -> down_proj input channel 7 ~ 3000
    with torch.no_grad():
        assert torch.isfinite(model(ids)).all()
        with quantize_activations(model, "fp8-e4m3"):
            assert torch.isfinite(model(ids)).all()  # saturating: wrong, but finite
        with quantize_activations(model, "fp8-e4m3-nosat"):
            assert torch.isnan(model(ids)).any()
        with quantize_activations(model, "fp8-e4m3-nosat-dynamic"):
            assert torch.isfinite(model(ids)).all()
        absmax = collect_input_absmax(model, ids)
    assert absmax["layers.1.down_proj"][7] > 448


def test_activation_quant_kwargs_input(model: Tiny) -> None:
    lin = model.layers[0].up_proj
    x = torch.randn(3, 16) * 1000
    with quantize_activations(lin, "fp8-e4m3-nosat"):
        assert torch.isnan(lin(input=x)).any()
        assert torch.isnan(lin(x)).any()


def test_collect_input_absmax(model: Tiny, ids: torch.Tensor) -> None:
    x_seen: dict[str, torch.Tensor] = {}

    def grab(name: str):
        def hook(m: nn.Module, a: tuple) -> None:
            x_seen[name] = a[0].detach().abs().reshape(-1, a[0].shape[-1]).amax(0)
        return hook

    handles = [m.register_forward_pre_hook(grab(n)) for n, m in find_linears(model)]
    model(ids)
    for h in handles:
        h.remove()
    stats = collect_input_absmax(model, ids)
    assert set(stats) == set(x_seen)
    for n, v in stats.items():
        assert v.dtype == torch.float32 and v.device.type == "cpu"
        assert torch.equal(v, x_seen[n])
    assert _hook_count(model) == 0
    # running max over several calls, via a callable
    stats2 = collect_input_absmax(model, lambda: (model(ids), model(ids * 0)))
    assert torch.equal(stats2["lm_head"], stats["lm_head"].maximum(
        collect_input_absmax(model, ids * 0)["lm_head"]))
    # hooks removed when the calibration run raises
    with pytest.raises(IndexError):
        collect_input_absmax(model, torch.tensor([[999]]))
    assert _hook_count(model) == 0
    assert stats["layers.0.down_proj"].shape == (40,)


def test_salient_weight_quant_on_model(model: Tiny, ids: torch.Tensor) -> None:
    stats = collect_input_absmax(model, {"ids": ids})
    before = model.layers[0].down_proj.weight.clone()
    top = int(stats["layers.0.down_proj"].argmax())
    with quantize_weights(model, "int4-g32-salient1pct", act_absmax=stats) as b:
        assert len(b.modules) == 4
        w = model.layers[0].down_proj.weight
        assert torch.equal(w[:, top], before[:, top].half().float())
    assert torch.equal(model.layers[0].down_proj.weight, before)
