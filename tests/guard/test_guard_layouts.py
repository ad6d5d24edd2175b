"""Per-layer fallbacks on quantized layers: the dense weight each fallback builds equals the
dequantization written from the published format (tests/guard/layout_helpers.py), only the
tripped layer is dequantized, and a guarded forward recovers finite output.

Real library layers where the library installs here: compressed-tensors (its own
`compress_module` packs the layer) and bitsandbytes (Linear4bit NF4, Linear8bitLt). AutoAWQ and
GPTQ kernels do not install on this CPU / torch: their layers are built in the published layout.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from qforensics.guard import guard
from qforensics.guard.fallbacks import choose_fallback
from qforensics.guard.layouts import (AwqGemm, BitsAndBytes4bit, BitsAndBytes8bit,
                                      CompressedPacked, Fp8Weight, GptqPacked)
from qforensics.guard.policy import GuardPolicy
import layout_helpers as H

CASES = {
    "awq": (H.make_awq, AwqGemm),
    "gptq-act-order": (lambda: H.make_gptq(act_order=True), GptqPacked),
    "gptq": (lambda: H.make_gptq(act_order=False), GptqPacked),
    "compressed-tensors-w4a16": (H.make_compressed_tensors, CompressedPacked),
    "fp8-tensor": (lambda: H.make_fp8(scale="tensor"), Fp8Weight),
    "fp8-channel": (lambda: H.make_fp8(scale="channel"), Fp8Weight),
    "fp8-block": (lambda: H.make_fp8(scale="block"), Fp8Weight),
    "bnb-nf4": (H.make_bnb4, BitsAndBytes4bit),
    "bnb-int8": (H.make_bnb8, BitsAndBytes8bit),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_dense_weight_matches_the_published_format(case):
    make, cls = CASES[case]
    layer, expected = make()
    fb, why = choose_fallback("layer", layer, GuardPolicy())
    assert why == "" and type(fb) is cls
    assert not fb.materialized  # nothing is dequantized before a trip
    w = fb.weight_for(torch.float32)
    assert w.shape == expected.shape and w.dtype == torch.float32
    torch.testing.assert_close(w, expected, rtol=1e-6, atol=1e-6)
    assert fb.weight_for(torch.float32) is w  # once: kept after the first build
    assert fb.weight_for(torch.float16) is w  # the activation dtype of the first trip


def test_activation_dtype_of_the_first_trip_is_kept():
    layer, expected = H.make_awq()
    fb, _ = choose_fallback("layer", layer, GuardPolicy())
    w = fb.weight_for(torch.float16)
    assert w.dtype == torch.float16
    torch.testing.assert_close(w.float(), expected, rtol=1e-3, atol=1e-3)


def test_compressed_tensors_agrees_with_the_library_decompressor():
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    layer, expected = H.make_compressed_tensors()
    sd = {n: t for n, t in layer.named_parameters()}
    lib = PackedQuantizationCompressor.decompress(sd, layer.quantization_scheme)["weight"]
    fb, _ = choose_fallback("layer", layer, GuardPolicy())
    torch.testing.assert_close(fb.weight_for(torch.float32), lib.float())
    torch.testing.assert_close(lib.float(), expected)


def _reference(model: H.Tiny, x: torch.Tensor, alt_in=None) -> torch.Tensor:
    """The guarded forward written out: the layer's own output where finite, the dense path
    (the test's expected weight, in float32) where not."""
    h = model.up(x)
    raw = model.q(h)
    alt = (h if alt_in is None else alt_in(h)) @ model._expected.t()
    return model.head(torch.relu(torch.where(torch.isfinite(raw), raw, alt)))


def _fp8_saturating(layer):
    def quant(h):
        s = layer.input_scale if hasattr(layer, "input_scale") else \
            h.abs().amax(-1, keepdim=True) / 448.0
        return (h / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    return quant


@pytest.mark.parametrize("case", ["awq", "gptq-act-order", "compressed-tensors-w4a16",
                                  "fp8-channel", "fp8-block", "bnb-nf4"])
def test_guarded_forward_recovers_finite_output(case):
    make, _ = CASES[case]
    layer, expected = make()
    outer = layer
    if case.startswith("compressed"):
        outer = H.CompressedKernel(layer, expected).attach_kernel()
    model = H.Tiny(outer, expected.shape[1], expected.shape[0])
    model._expected = expected
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    x[1] *= 1e5 if not case.startswith("fp8") else 1e2  # one outlier token
    with torch.no_grad():
        bad = model(x)
    assert not torch.isfinite(bad).all()  # the layer itself fails on this input
    name = "q.inner" if case.startswith("compressed") else "q"
    with torch.no_grad(), guard(model) as g:
        out = model(x)
        assert g.names == [name]  # auto: only the quantized layer is guarded
        assert g.fallback(name).materialized
    assert torch.isfinite(out).all()
    assert g.stats.trips == 1 and g.stats.repaired_steps == 1 and g.stats.sanitized_steps == 0
    assert [(i["module"], i["action"]) for i in g.incidents] == [(name, "fallback")]
    with torch.no_grad():
        ref = _reference(model, x, _fp8_saturating(layer) if case.startswith("fp8") else None)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-3)


def test_only_the_tripped_layer_is_dequantized():
    a, wa = H.make_awq(seed=10)
    b, wb = H.make_gptq(seed=11)
    model = nn.Sequential(nn.Linear(16, 128), a, nn.Linear(64, 128), b)
    x = torch.randn(2, 16)
    with torch.no_grad():
        model[0].weight.mul_(0.01)
        model[2].weight.mul_(1e-9)  # keeps the second quantized layer's input small
        x[0] *= 1e7  # huge: the first quantized layer overflows float16
        assert not torch.isfinite(model(x)).all()
        with guard(model) as g:
            out = model(x)
    assert torch.isfinite(out).all()
    assert g.names == ["1", "3"]
    assert g.fallback("1").materialized and not g.fallback("3").materialized
    assert g.state("1") == "suspect" and g.state("3") == "healthy"


class MysteryQuantLinear(nn.Module):
    """A quantized layer no fallback knows: int8 codes and a scale in an unpublished layout."""

    def __init__(self):
        super().__init__()
        self.register_buffer("qweight", torch.zeros(4, 4, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(3))

    def forward(self, x):
        return x[..., :4] * float("nan")


def test_unknown_layer_has_no_fallback_and_never_breaks_the_model(caplog):
    model = nn.Sequential(nn.Linear(8, 8), MysteryQuantLinear(), nn.Linear(4, 5))
    caplog.set_level(logging.WARNING, logger="qforensics.guard")
    x = torch.randn(2, 8)
    with torch.no_grad(), guard(model) as g:
        out = model(x)  # no exception escapes
    assert g.names == ["1"] and g.fallback("1") is None
    why = g.no_fallback_reason("1")
    assert why.startswith("no fallback for MysteryQuantLinear") and "fallback_weights" in why
    assert "no fallback" in caplog.text and "MysteryQuantLinear" in caplog.text
    assert torch.isfinite(out).all()  # last resort: sanitized, and said so
    assert g.stats.sanitized_steps == 1
    assert g.incidents[-1]["action"] == "sanitize_logits"
    assert "1 produced it and has no fallback" in g.incidents[-1]["detail"]
    assert g.failed is None


def test_refusals_say_why():
    layer, _ = H.make_awq()
    layer.w_bit = 3
    ok, why = AwqGemm.can_take(layer)
    assert not ok and "3-bit AWQ" in why
    fp8, _ = H.make_fp8()
    del fp8.weight_scale
    ok, why = Fp8Weight.can_take(fp8)
    assert not ok and "no weight_scale" in why


def test_fp8_fallback_quantizes_activations_like_the_layer():
    """Static input_scale: saturating at ±448·input_scale; none: a per-token dynamic scale."""
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
    x[0, 5] = 1e4  # beyond the static range
    for static in (True, False):
        layer, expected = H.make_fp8(static_input=static)
        fb, _ = choose_fallback("layer", layer, GuardPolicy())
        s = torch.tensor(0.02) if static else x.abs().amax(-1, keepdim=True) / 448.0
        xq = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
        torch.testing.assert_close(fb(x, torch.float32), xq @ expected.t(), rtol=1e-5,
                                   atol=1e-4)
        assert torch.isfinite(fb(x, torch.float32)).all()


def _quanto(dtype):
    from optimum.quanto import freeze, qint8, quantize

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 64), nn.Linear(64, 10)).to(dtype)
    with torch.no_grad():
        model[1].weight.mul_(1e-3)
    w0 = model[0].weight.detach().float().clone()
    quantize(model, weights=qint8, include=["0"])  # the library swaps in its QLinear
    freeze(model)
    return model, w0


def test_optimum_quanto_qlinear():
    """The real optimum-quanto QLinear (int8 weights, frozen): the dense weight is quanto's
    per-row symmetric int8 (scale = row absmax / 127, written out here), and a float16 run that
    overflows in the layer is recovered by the float32 fallback."""
    model, w0 = _quanto(torch.float32)
    s = w0.abs().amax(1, keepdim=True) / 127
    fb, why = choose_fallback("0", model[0], GuardPolicy())
    assert why == "" and type(fb).__name__ == "QuantoWeight"
    torch.testing.assert_close(fb.weight_for(torch.float32), torch.round(w0 / s) * s)
    model, w0 = _quanto(torch.float16)
    x = (torch.sign(w0[0]) * 6e4).half().reshape(1, 256)  # row 0 of the output overflows
    with torch.no_grad():
        assert not torch.isfinite(model(x)).all()
        with guard(model) as g:
            out = model(x)
    assert g.names == ["0"] and torch.isfinite(out).all()
    assert g.stats.trips == 1 and g.stats.sanitized_steps == 0
