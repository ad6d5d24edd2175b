"""Scheme spec parsing: valid forms round-trip, bad forms fail with the list of valid forms."""

from __future__ import annotations

import pytest
import torch

from qforensics.errors import QForensicsError, UsageError
from qforensics.quant import (
    QuantScheme,
    QuantSchemeError,
    fake_quant_fp8,
    fake_quant_int,
    parse_scheme,
)


@pytest.mark.parametrize(
    "spec,target",
    [
        ("int4-per-tensor", "weights"),
        ("int4-per-channel", "weights"),
        ("int4-g128", "weights"),
        ("int4-g64", "weights"),
        ("int4-g32", "activations"),
        ("int8-per-tensor", "activations"),
        ("int8-per-token", "activations"),
        ("fp8-e4m3", "activations"),
        ("fp8-e4m3-nosat", "activations"),
        ("fp8-e5m2", "weights"),
        ("fp8-e5m2-nosat-dynamic", "activations"),
        ("int4-g128-salient1pct", "weights"),
        ("int4-g128-salient0.5pct", "weights"),
    ],
)
def test_valid_specs_round_trip(spec: str, target: str) -> None:
    s = parse_scheme(spec, target)  # type: ignore[arg-type]
    assert str(s) == spec and s.target == target
    assert parse_scheme(str(s), target) == s  # type: ignore[arg-type]
    assert parse_scheme(spec.upper() + " ", target) == s  # type: ignore[arg-type]


def test_fields() -> None:
    s = parse_scheme("int4-g128-salient1pct")
    assert (s.kind, s.bits, s.granularity, s.group_size, s.keep_salient) == (
        "int", 4, "group", 128, 0.01)
    f = parse_scheme("fp8-e4m3-nosat", "activations")
    assert (f.kind, f.fp8_format, f.saturate, f.dynamic_scale) == ("fp8", "e4m3", False, False)
    assert parse_scheme("int4-g64", keep_salient=0.02).keep_salient == 0.02
    assert parse_scheme("fp8-e4m3fn") == parse_scheme("fp8-e4m3")


@pytest.mark.parametrize(
    "spec,target",
    [
        ("int3-g128", "weights"),
        ("int4", "weights"),
        ("int4-g0", "weights"),
        ("int4-per-token", "weights"),
        ("int4-per-channel", "activations"),
        ("int4-g128-salient1pct", "activations"),
        ("int4-g128-salient0pct", "weights"),
        ("int4-g128-salient100pct", "weights"),
        ("fp8-e4m3-nosat-nosat", "weights"),
        ("fp8-e3m4", "weights"),
        ("", "weights"),
        ("int4-g128", "biases"),
    ],
)
def test_bad_specs(spec: str, target: str) -> None:
    with pytest.raises(QuantSchemeError) as info:
        parse_scheme(spec, target)  # type: ignore[arg-type]
    assert isinstance(info.value, QForensicsError) and isinstance(info.value, UsageError)
    if target in ("weights", "activations"):
        assert "int4-g128" in str(info.value) and "fp8-e4m3-nosat" in str(info.value)


def test_bad_keep_salient() -> None:
    with pytest.raises(QuantSchemeError):
        parse_scheme("int4-g128", keep_salient=1.5)
    with pytest.raises(QuantSchemeError):
        parse_scheme("fp8-e4m3", keep_salient=0.01)
    with pytest.raises(QuantSchemeError):
        parse_scheme("int4-g128-salient1pct", keep_salient=0.02)


def test_scheme_passthrough_and_target_check() -> None:
    s = parse_scheme("int8-per-token", "activations")
    assert parse_scheme(s, "activations") is s
    with pytest.raises(QuantSchemeError):
        parse_scheme(s, "weights")


def test_fake_quant_dispatch() -> None:
    x = torch.randn(4, 100) * 200
    assert torch.equal(parse_scheme("int4-g32").fake_quant(x), fake_quant_int(x, 4, "group", 32))
    x[0, 0] = 3000.0
    got = parse_scheme("fp8-e4m3-nosat", "activations").fake_quant(x)
    assert torch.isnan(got[0, 0])
    assert torch.allclose(got, fake_quant_fp8(x, "e4m3", saturate=False), 0, 0, equal_nan=True)
    with pytest.raises(QuantSchemeError):
        parse_scheme("int4-g32-salient1pct").fake_quant(x)  # needs salient channels
    assert isinstance(parse_scheme("int8-per-tensor"), QuantScheme)
