"""Risk (qforensics.whatif.risk) from a real trace of a tiny model whose inputs are chosen so
that the expected levels follow from arithmetic on the formats, not from the code.

Linear ``a`` (in_features 128) sees one token whose channel 0 is 1000 and the other 127 are 1;
Linear ``b`` (in_features 96) sees 96 ones.

- INT8 per token, ``a``: the token's scale is 1000 / 127 = 7.87; every channel of absmax 1 is
  below half of it (3.94) and rounds to 0: 127 of 128 channels, more than the 50% analyze
  calls unsafe. ``b``: scale 1 / 127, nothing rounds to 0. So ct:W8A8 (int8 per-token
  activations on every Linear) is high risk, 1 of 2 Linears unsafe.
- FP8 E4M3 with a static scale of 1: 1000 > 448 overflows in ``a``: high.
- salient channels: ``a``'s largest channel is 1000 x its median (1) >= 20; ``b``'s is 1 x.
  4-bit weights (ct:W4A16, group 128: only ``a``, since 96 is not a multiple of 128) are
  elevated, 1 of 1 Linear; 8-bit weights (ct:W8A16) low; the same 4-bit weights with the
  salient channels kept (w:int4-g128-salient1pct) low.
- With both inputs flat (every channel 1) nothing is predicted: none. Without a trace: unknown.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qforensics
from qforensics.whatif.risk import scheme_risk, trace_evidence
from qforensics.whatif.schemes import parse_whatif_scheme


class Split(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(128, 8)
        self.b = nn.Linear(96, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x[..., :128]) + self.b(x[..., 128:])


def _trace(tmp_path, outlier: float):
    x = torch.ones(1, 1, 224)
    x[..., 0] = outlier
    path = tmp_path / "split.h5"
    model = Split()
    with qforensics.capture(model, path), torch.no_grad():
        model(x)
    return path


@pytest.fixture
def evidence(tmp_path):
    return trace_evidence(_trace(tmp_path, 1000.0))


def _risk(spec: str, ev) -> dict:
    return scheme_risk(parse_whatif_scheme(spec), ev)


def test_quantized_activations_are_high_risk_where_channels_round_to_zero(evidence) -> None:
    pytest.importorskip("compressed_tensors")
    r = _risk("ct:W8A8", evidence)
    assert r["level"] == "high", r
    act = r["activations"]
    assert act["format"] == "int8-per-token" and (act["unsafe"], act["linears"]) == (1, 2)
    assert act["worst"] == {"module": "a", "channels_zeroed": 127, "channels": 128,
                            "overflow": 0}
    assert _risk("act:int8-per-token", evidence)["level"] == "high"


def test_a_static_fp8_scale_overflows(evidence) -> None:
    r = _risk("act:fp8-e4m3-nosat", evidence)
    assert r["level"] == "high" and r["activations"]["worst"]["overflow"] == 1, r


def test_salient_channels_raise_the_risk_of_4_bit_weights(evidence) -> None:
    pytest.importorskip("compressed_tensors")
    w4 = _risk("ct:W4A16", evidence)
    assert w4["level"] == "elevated", w4
    sal = w4["salient"]
    assert (sal["linears_with_salient"], sal["linears"]) == (1, 1)  # b: 96 % 128 != 0
    assert sal["largest"]["module"] == "a" and sal["largest"]["times_median"] == 1000
    assert w4["activations"] is None
    assert _risk("ct:W8A16", evidence)["level"] == "low"
    assert _risk("w:int4-g128-salient1pct", evidence)["level"] == "low"
    assert _risk("w:int4-g128", evidence)["level"] == "elevated"
    # 8-bit weights with per-token activations: the activations decide
    assert _risk("ct:W8A8", evidence)["salient"]["linears"] == 2


def test_flat_inputs_predict_nothing_and_no_trace_is_unknown(tmp_path) -> None:
    pytest.importorskip("compressed_tensors")
    flat = trace_evidence(_trace(tmp_path, 1.0))
    for spec in ("ct:W8A8", "ct:W4A16", "act:fp8-e4m3-nosat"):
        assert _risk(spec, flat)["level"] == "none", spec
    none = _risk("ct:W4A16", None)
    assert none["level"] == "unknown" and none["evidence"] is None


def test_the_table_and_json_carry_risk(evidence) -> None:
    import json

    from qforensics.whatif.results import SchemeResult, WhatIfResult
    from qforensics.whatif.risk import attach_risk

    res = WhatIfResult(trace=None, prompt_source="p", salient_source="s", ref_text="t",
                       ref_ppl=10.0, positions=8, text_tokens=100)
    res.schemes.append(SchemeResult("w:int4-g128", "int4-g128", None, 1.0, 0.0, 10.0, 1.0,
                                    1.0, False, "", 0.0))
    attach_risk(res, [parse_whatif_scheme("w:int4-g128")], None)
    assert res.schemes[0].risk["level"] == "unknown"
    res.schemes[0].risk = scheme_risk(parse_whatif_scheme("w:int4-g128"), evidence)
    table = res.format_table()
    row = next(ln for ln in table.splitlines() if ln.startswith("w:int4-g128 "))
    assert row.split()[-1] == "elevated"
    assert "  w:int4-g128: elevated: salient input channels in 1 of 2 Linears" in table
    doc = json.loads(json.dumps(res.to_json(), allow_nan=False))
    assert doc["schemes"][0]["risk"]["level"] == "elevated"


class Parts(nn.Module):
    """``Split``'s two Linears under an attention and an MLP module: attn.a (128 inputs, the
    outlier token) and mlp.b (96 flat inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.ModuleDict({"a": nn.Linear(128, 8)})
        self.mlp = nn.ModuleDict({"b": nn.Linear(96, 8)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn["a"](x[..., :128]) + self.mlp["b"](x[..., 128:])


def test_a_mixed_recipe_is_rated_per_part_over_its_own_linears(tmp_path) -> None:
    pytest.importorskip("compressed_tensors")
    x = torch.ones(1, 1, 224)
    x[..., 0] = 1000.0
    path = tmp_path / "parts.h5"
    model = Parts()
    with qforensics.capture(model, path), torch.no_grad():
        model(x)
    ev = trace_evidence(path)
    # int8 per-token activations on attn.a zero 127 of its 128 channels: high; 4-bit weights
    # in group 128 take no MLP Linear (96 inputs): no evidence for that part
    r = _risk("ct:attn=W8A8,mlp=W4A16", ev)
    assert r["level"] == "high" and r["parts"]["attn"]["level"] == "high", r
    assert r["parts"]["attn"]["activations"]["linears"] == 1  # attn.a only, not mlp.b
    assert r["parts"]["mlp"]["level"] == "unknown"
    # the other way round: 4-bit weights on the salient attn.a; int8 on mlp.b's flat inputs
    r = _risk("ct:attn=W4A16,mlp=W8A8", ev)
    assert r["level"] == "elevated", r
    assert r["parts"]["attn"]["salient"]["largest"]["module"] == "attn.a"
    assert r["parts"]["mlp"]["level"] == "none"
    assert r["line"].startswith("attn: elevated: ") and "; mlp: none: " in r["line"]
    # attn.a kept in bf16: its part quantizes nothing, so the trace says nothing about it
    r = _risk("ct:attn=W4A16,mlp=W8A8,keep=attn.a", ev)
    assert r["parts"]["attn"]["level"] == "unknown" and r["level"] == "unknown", r
