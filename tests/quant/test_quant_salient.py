"""Salient-channel (AWQ-style) protection: selection and the FP16-kept columns."""

from __future__ import annotations

import pytest
import torch

from qforensics.quant import (
    QuantSchemeError,
    fake_quant_int,
    parse_scheme,
    quantize_weight_salient,
    select_salient_channels,
)


def test_select_top_fraction_at_least_one() -> None:
    a = torch.ones(576)
    a[1229 % 576] = 3000.0
    a[100] = 2000.0
    assert select_salient_channels(a, 0.001).tolist() == [1229 % 576]  # ceil(0.576) = 1
    assert select_salient_channels(a, 0.01).numel() == 6  # ceil(5.76)
    assert set(select_salient_channels(a, 0.01).tolist()) >= {100, 1229 % 576}
    idx = select_salient_channels(a, 0.5)
    assert idx.dtype == torch.int64 and torch.all(idx[1:] > idx[:-1])


def test_select_nan_counts_as_largest_and_ties_deterministic() -> None:
    a = torch.tensor([1.0, float("nan"), 5.0, 5.0, 0.0])
    assert select_salient_channels(a, 0.2).tolist() == [1]
    assert select_salient_channels(a, 0.6).tolist() == [1, 2, 3]
    assert select_salient_channels(torch.zeros(8), 0.25).tolist() == [0, 1]


def test_select_bad_input() -> None:
    with pytest.raises(QuantSchemeError):
        select_salient_channels(torch.ones(2, 2), 0.1)
    with pytest.raises(QuantSchemeError):
        select_salient_channels(torch.ones(4), 0.0)


def test_salient_columns_exact_to_fp16_and_rest_improves() -> None:
    torch.manual_seed(0)
    w = torch.randn(32, 200) * 0.02
    w[:, 150] = torch.randn(32) * 5 + 40.123456  # outlier column in the tail-ish group
    idx = torch.tensor([150])
    q = quantize_weight_salient(w, idx, bits=4, group_size=64)
    assert torch.equal(q[:, 150], w[:, 150].half().float())
    # the outlier no longer inflates its group's scale: others in that group get a fine grid
    plain = fake_quant_int(w, 4, "group", 64)
    grp = slice(128, 192)
    mask = torch.ones(200, dtype=torch.bool)
    mask[150] = False
    err_plain = (plain - w)[:, grp][:, mask[grp]].abs().mean()
    err_prot = (q - w)[:, grp][:, mask[grp]].abs().mean()
    assert err_prot < err_plain / 5
    # the rest equals plain group quant of W with the salient column zeroed
    w0 = w.clone()
    w0[:, 150] = 0
    ref = fake_quant_int(w0, 4, "group", 64)
    assert torch.equal(q[:, mask], ref[:, mask])


def test_salient_keeps_dtype_and_negative_index() -> None:
    w = torch.randn(8, 70, dtype=torch.bfloat16)
    q = quantize_weight_salient(w, [-1], bits=4, group_size=32)
    assert q.dtype == torch.bfloat16
    assert torch.equal(q[:, 69], w[:, 69].half().to(torch.bfloat16))
    with pytest.raises(QuantSchemeError):
        quantize_weight_salient(w, [70])


def test_scheme_with_salient_dispatches() -> None:
    w = torch.randn(8, 256)
    s = parse_scheme("int4-g128-salient1pct")
    q = s.fake_quant(w, torch.tensor([3, 7]))
    assert torch.equal(q, quantize_weight_salient(w, [3, 7], bits=4, group_size=128))
