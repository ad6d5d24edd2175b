"""Cause and silent-failure evidence on the real SmolLM2-135M: a weight row the test corrupts, a
static FP8 input_scale calibrated without the first token (expectations from the test's own
plain hook), and FP8 with correct static scales staying PASSED."""

from __future__ import annotations

import functools

import pytest
import torch

import qforensics
from qforensics.analyze import FAILED, PASSED, SUSPECT, analyze_trace
from qforensics.quant.static import calibrate_input_scales, emulate_static_fp8

pytestmark = pytest.mark.model

DOWN = "model.layers.11.mlp.down_proj"


def _generate(model, enc, n: int):
    with torch.inference_mode():
        return model.generate(enc["input_ids"], attention_mask=enc["attention_mask"],
                              max_new_tokens=n, do_sample=False, temperature=None, top_p=None,
                              top_k=None, pad_token_id=0)


def test_corrupted_weight_row_is_the_cause(smollm2, tmp_path):
    model, _, enc = smollm2
    name = "model.layers.3.mlp.up_proj"
    w = dict(model.named_modules())[name].weight
    saved = w.detach()[42].clone()
    try:
        with torch.no_grad():
            w[42, 9] = float("nan")
        with qforensics.capture(model, tmp_path / "c.h5"):
            _generate(model, enc, 2)
    finally:
        with torch.no_grad():
            w[42].copy_(saved)
    f = analyze_trace(tmp_path / "c.h5")
    assert f.status == FAILED and f.first_nonfinite.producer == name
    assert f.cause.kind == "corrupted_parameters"
    t = f.cause.tensors[0]
    assert (t["param"], t["row"], t["nan"]) == ("weight", 42, 1)
    assert "row 42, column 9" in f.verdict.line
    nl = f.nonfinite_logits
    assert nl is not None and nl.step == 0 and nl.next_token == 0  # all-NaN row: argmax 0


def _plain_input(model, enc, module: str) -> torch.Tensor:
    got = {}

    def hook(_m, args):
        got["x"] = args[0].detach().clone()

    h = dict(model.named_modules())[module].register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            model(enc["input_ids"])
    finally:
        h.remove()
    return got["x"][0]  # [tokens, channels]


def test_static_fp8_scale_too_low_reads_suspect_and_names_the_channels(smollm2, tmp_path):
    model, _, enc = smollm2
    x = _plain_input(model, enc, DOWN)
    low = float(x[1:].abs().max()) / 448  # what a calibration without token 0 finds
    scales = calibrate_input_scales(model, functools.partial(model, enc["input_ids"]),
                                    skip_tokens=1)
    assert scales[DOWN] == pytest.approx(low, rel=1e-5)
    seen: list[torch.Tensor] = []  # a plain hook on the same run: the layer's input per step
    with emulate_static_fp8(model, scales):
        layer = dict(model.named_modules())[DOWN]
        h = layer.register_forward_pre_hook(
            lambda _m, a: seen.append(a[0].detach().reshape(-1, a[0].shape[-1]).abs().amax(0)))
        try:
            with qforensics.capture(model, tmp_path / "s.h5"):
                _generate(model, enc, 8)
        finally:
            h.remove()
    f = analyze_trace(tmp_path / "s.h5")
    assert f.status == SUSPECT and f.first_nonfinite is None
    ev = {e.kind: e for e in f.evidence}["static_range_overrun"]
    d = {x["module"]: x for x in ev.details}[DOWN]
    assert d["input_scale"] == pytest.approx(low, rel=1e-5) and d["format"] == "fp8-e4m3"
    expected = seen[d["step"]].double() / (low * 448)
    want = int(expected.argmax())
    top = d["channels_over"][0]
    assert top["channel"] == want == 1229
    assert top["times_range"] == pytest.approx(float(expected[want]), rel=1e-3)
    over = {c["channel"] for c in d["channels_over"]}
    assert over <= set(torch.nonzero(expected > 1).flatten().tolist())
    peak = max(float(s.max()) for s in seen) / (low * 448)
    assert d["overrun"] == pytest.approx(peak, rel=1e-3)
    assert DOWN in f.verdict.line and "input_scale" in f.verdict.line


def test_static_fp8_with_correct_scales_stays_passed(smollm2, tmp_path):
    model, _, enc = smollm2
    scales = calibrate_input_scales(model, functools.partial(model, enc["input_ids"]))
    with emulate_static_fp8(model, scales), qforensics.capture(model, tmp_path / "ok.h5"):
        _generate(model, enc, 8)
    f = analyze_trace(tmp_path / "ok.h5")
    assert f.status == PASSED, f.verdict.line
