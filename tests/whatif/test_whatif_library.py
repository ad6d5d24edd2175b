"""ct:PRESET what-if schemes run through the real compressed-tensors library: the weights the
library's forward uses equal symmetric INT4 group-128 quantization written out by hand, the
model is left exactly as it was, and the CLI measures a ct: scheme on a user model."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from qforensics.cli import main
from qforensics.errors import UsageError
from qforensics.whatif.library import applied_compressed_tensors
from qforensics.whatif.run import parse_whatif_scheme


def _int4_g128_symmetric(w: torch.Tensor) -> torch.Tensor:
    """W4A16: int4 in [-8, 7], one scale per 128 inputs = absmax / 7.5 (range 15 / 2)."""
    out = torch.empty_like(w)
    for r in range(w.shape[0]):
        for g0 in range(0, w.shape[1], 128):
            blk = w[r, g0:g0 + 128]
            scale = max(float(blk.abs().max()), 1e-12) / 7.5
            out[r, g0:g0 + 128] = torch.clamp(torch.round(blk / scale), -8, 7) * scale
    return out


def test_w4a16_through_the_library_matches_the_format_and_is_undone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 8))
    model.lm_head = nn.Linear(8, 8)  # excluded, like a model's output layer
    x = torch.randn(5, 256)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ref = model[0](x)
    with torch.no_grad(), applied_compressed_tensors(model, "W4A16") as n:
        got = model[0](x)
        assert n == 1  # 64 in-features: not a multiple of the group; the lm_head excluded
    want = nn.functional.linear(x, _int4_g128_symmetric(model[0].weight.detach()),
                                model[0].bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, ref)
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert "forward" not in model[0].__dict__ and not hasattr(model[0], "quantization_scheme")


def test_scheme_specs():
    sc = parse_whatif_scheme("ct:w4a16")
    assert (sc.label, sc.library, sc.preset) == ("ct:W4A16", "compressed-tensors", "W4A16")
    with pytest.raises(UsageError, match="not a compressed-tensors preset"):
        parse_whatif_scheme("ct:W9A1")
    with pytest.raises(UsageError, match="calibrated static scale"):
        parse_whatif_scheme("ct:FP8")


def test_cli_measures_a_ct_scheme_on_a_user_model(tmp_path, demo):
    from test_whatif_user_model import _save, _trace_of

    folder = _save(tmp_path, demo, layers=2)
    # hidden 32 / intermediate 64 are below the group of 128: the library takes no Linear,
    # and the run says so (exit 2) rather than report an unquantized model as quantized
    trace = _trace_of(folder, tmp_path, demo)
    r = CliRunner().invoke(main, ["whatif", str(trace), "--scheme", "ct:W4A16",
                                  "--max-new-tokens", "4", "--text-tokens", "16"])
    assert r.exit_code == 2 and "took no Linear" in r.output, r.output
    r = CliRunner().invoke(main, ["whatif", str(trace), "--scheme", "ct:W8A8",
                                  "--scheme", "w:int8-per-channel",
                                  "--max-new-tokens", "4", "--text-tokens", "16"])
    assert r.exit_code == 0, r.output
    assert "ct:W8A8" in r.output
