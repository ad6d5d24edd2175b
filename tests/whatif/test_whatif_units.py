"""What-if building blocks without the real model: salient channels from a captured trace,
the metrics on known inputs, scheme parsing and CLI errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

import qforensics
from qforensics.cli import main
from qforensics.errors import UsageError
from qforensics.quant import select_salient_channels
from qforensics.quant.errors import QuantSchemeError
from qforensics.whatif.metrics import (
    mean_kl,
    perplexity,
    recovered_fraction,
    top1_agreement,
)
from qforensics.whatif.run import (
    TABLE_SCHEMES,
    parse_keep_salient,
    parse_whatif_scheme,
    reference_text,
)
from qforensics.whatif.salient import absmax_from_trace


class TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 4)
        self.b = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def _capture(tmp_path, steps, **opts):
    model = TwoLinears()
    path = tmp_path / "tiny.h5"
    with qforensics.capture(model, path, **opts):
        for x in steps:
            model(x)
    return model, path


def test_absmax_from_trace_is_max_abs_of_recorded_ranges_over_steps(tmp_path) -> None:
    x0 = torch.tensor([[1.0, -9.0, 0.5, 0.0, 2.0, -1.0]])
    x1 = torch.tensor([[-3.0, 1.0, 0.25, 7.0, 0.0, 1.0], [0.0, 0.0, 0.0, -8.0, 0.0, 0.0]])
    model, path = _capture(tmp_path, [x0, x1])
    ta = absmax_from_trace(path)
    assert set(ta.absmax) == {"a", "b"} and ta.steps == [0, 1] and ta.records == 4
    np.testing.assert_allclose(ta.absmax["a"], [3, 9, 0.5, 8, 2, 1])
    with torch.no_grad():
        hid = torch.cat([model.a(x0), model.a(x1)]).abs().amax(0)
    np.testing.assert_allclose(ta.absmax["b"], hid.numpy(), rtol=1e-6)
    # the salient pick is the largest recorded channels
    idx = select_salient_channels(torch.from_numpy(ta.absmax["a"]), 2 / 6)
    assert idx.tolist() == [1, 3]
    assert "2 steps" in ta.describe()


def test_absmax_from_trace_filters_modules_and_skips_steps_without_channels(tmp_path) -> None:
    xs = [torch.ones(1, 6), torch.full((1, 6), 5.0)]
    _, path = _capture(tmp_path, xs, channel_steps="1")
    ta = absmax_from_trace(path, ["a"])
    assert list(ta.absmax) == ["a"] and ta.steps == [1]
    np.testing.assert_allclose(ta.absmax["a"], np.full(6, 5.0))
    (tmp_path / "none").mkdir()
    _, path2 = _capture(tmp_path / "none", xs, channel_steps="none")
    empty = absmax_from_trace(path2)
    assert empty.absmax == {} and "no per-channel" in empty.describe()


def test_top1_agreement_known_inputs() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert top1_agreement(logits, torch.tensor([1, 0, 0, 0])) == 0.75
    logits[3, 0] = float("nan")  # a NaN row never agrees
    assert top1_agreement(logits, torch.tensor([1, 0, 2, 0])) == 0.75
    assert math.isnan(top1_agreement(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long)))
    with pytest.raises(ValueError):
        top1_agreement(logits, torch.tensor([1, 0]))


def test_mean_kl_known_inputs() -> None:
    p = torch.tensor([[math.log(0.5), math.log(0.5)]], dtype=torch.float64)
    q = torch.tensor([[math.log(0.9), math.log(0.1)]], dtype=torch.float64)
    want = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert mean_kl(p, q) == pytest.approx(want, rel=1e-12)
    assert mean_kl(q, q) == pytest.approx(0.0, abs=1e-12)
    # mean over positions, shift invariance of logits
    two = mean_kl(torch.cat([p, p]), torch.cat([q + 3.0, p]))
    assert two == pytest.approx(want / 2, rel=1e-12)
    assert math.isnan(mean_kl(p, torch.tensor([[float("nan"), 0.0]])))
    # the reference puts no mass on a token the model gives -inf: no contribution
    assert mean_kl(torch.tensor([[0.0, -math.inf]]), torch.tensor([[0.0, -50.0]])) == \
        pytest.approx(0.0, abs=1e-12)


def test_perplexity_known_inputs() -> None:
    uniform = torch.zeros(5, 4)
    assert perplexity(uniform, torch.tensor([0, 1, 2, 3, 0])) == pytest.approx(4.0)
    sure = torch.tensor([[0.0, -math.inf], [-math.inf, 0.0]])
    assert perplexity(sure, torch.tensor([0, 1])) == pytest.approx(1.0)
    assert perplexity(sure, torch.tensor([1, 1])) == math.inf
    assert math.isnan(perplexity(torch.full((2, 3), float("nan")), torch.tensor([0, 1])))
    assert recovered_fraction(10.0, 12.5) == pytest.approx(0.8)
    assert recovered_fraction(10.0, math.nan) == 0.0 and recovered_fraction(10.0, math.inf) == 0


def test_reference_text_ships_with_the_package() -> None:
    text = reference_text()
    assert 4000 < len(text) < 12000 and text.isascii()


def test_parse_whatif_scheme_and_keep_salient() -> None:
    s = parse_whatif_scheme("int4-g128", parse_keep_salient("1%"))
    assert s.label == "w:int4-g128-salient1pct" and s.needs_salient
    a = parse_whatif_scheme("fp8-e4m3-nosat")
    assert a.weights is None and str(a.activations) == "fp8-e4m3-nosat"
    both = parse_whatif_scheme("w:int4-g128+act:int8-per-token")
    assert both.label == "w:int4-g128+act:int8-per-token"
    assert [parse_whatif_scheme(x).label for x in TABLE_SCHEMES] == list(TABLE_SCHEMES)
    assert parse_keep_salient("0.02") == 0.02 and parse_keep_salient(None) is None
    for bad in ("int5-g128", "q:int4-g128", "int4-g128+int8-per-tensor", ""):
        with pytest.raises(QuantSchemeError):
            parse_whatif_scheme(bad)
    for bad in ("abc", "0%", "100%", "1.5"):
        with pytest.raises(UsageError):
            parse_keep_salient(bad)


def test_cli_bad_scheme_exits_2(tmp_path) -> None:
    _, path = _capture(tmp_path, [torch.ones(1, 6)])
    r = CliRunner().invoke(main, ["whatif", str(path), "--scheme", "int5-g7"])
    assert r.exit_code == 2 and "bad quantization scheme 'int5-g7'" in r.output
    assert "Traceback" not in r.output


def test_cli_missing_trace_exits_2(tmp_path) -> None:
    r = CliRunner().invoke(main, ["whatif", str(tmp_path / "nope.h5"), "--scheme", "int4-g128"])
    assert r.exit_code == 2 and "no such file" in r.output


def test_cli_usage_errors_exit_2(tmp_path) -> None:
    _, path = _capture(tmp_path, [torch.ones(1, 6)])
    for args in ([], ["--keep-salient", "1%"], ["--scheme", "act:fp8-e4m3", "--keep-salient",
                                                  "1%"], ["--scheme", "int4-g128",
                                                          "--keep-salient", "300%"]):
        r = CliRunner().invoke(main, ["whatif", str(path), *args])
        assert r.exit_code == 2, (args, r.output)
        assert r.output.startswith("Error:")


def test_cli_help_has_an_example() -> None:
    r = CliRunner().invoke(main, ["whatif", "--help"])
    assert r.exit_code == 0 and "Example:" in r.output and "--keep-salient" in r.output
