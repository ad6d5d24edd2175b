"""`awq:w4a16[-g<N>]`: AWQ W4A16 in its published format, measured by the HF fake-quant path
(and through vLLM with --engine vllm: tests/engines/test_vllm_whatif.py). Expectations come
from the format's definition: asymmetric uint4 per group of N input rows, min/max range."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import qforensics
from qforensics.cli import main
from qforensics.errors import UsageError
from qforensics.whatif.run import parse_whatif_scheme
from qforensics.whatif.through_vllm import applied_awq, awq_group, check_awq_fits


class Toy(nn.Module):
    def __init__(self, k=128, n=16):
        super().__init__()
        self.proj = nn.Linear(k, n)
        self.lm_head = nn.Linear(n, 32)


def test_specs():
    assert awq_group("awq:w4a16") == 128 and awq_group("AWQ:W4A16-g64") == 64
    assert awq_group("int4-g64") is None
    with pytest.raises(UsageError, match="even number"):
        awq_group("awq:w4a16-g7")
    sc = parse_whatif_scheme("awq:w4a16-g64")
    assert (sc.label, sc.library, sc.awq_group) == ("awq:w4a16-g64", "awq", 64)


def test_hf_fake_quant_follows_the_awq_format_and_is_undone():
    torch.manual_seed(0)
    m = Toy()
    w0 = m.proj.weight.detach().clone()
    head0 = m.lm_head.weight.detach().clone()
    g = 32
    with applied_awq(m, g):
        w = m.proj.weight.detach()
        assert torch.equal(m.lm_head.weight, head0)  # lm_head stays unquantized
        for grp in range(w0.shape[1] // g):
            cols = slice(grp * g, (grp + 1) * g)
            orig, got = w0[:, cols], w[:, cols]  # [N, G]: one group per output row
            lo = orig.amin(1, keepdim=True).clamp(max=0)
            hi = orig.amax(1, keepdim=True).clamp(min=0)
            step = (hi - lo) / 15
            # scales are stored in float16, as AutoAWQ's checkpoint holds them
            assert bool(((got - orig).abs() <= step / 2 + step * 1e-2 + 1e-6).all())
            for row in got:
                assert len(torch.unique(row)) <= 16  # 4-bit: at most 16 levels per group
    assert torch.equal(m.proj.weight, w0)


def test_layers_awq_cannot_hold_are_refused():
    with pytest.raises(UsageError, match=r"model.proj|proj has in_features=96"):
        check_awq_fits(Toy(k=96), 64)
    check_awq_fits(Toy(k=128), 64)


def test_engine_vllm_usage_errors(tmp_path):
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    trace = tmp_path / "t.h5"
    with qforensics.capture(m, trace, metadata={"model_path": "demo"}):
        m(torch.ones(1, 4))
    r = CliRunner().invoke(main, ["whatif", str(trace), "--scheme", "int4-g128",
                                  "--engine", "vllm"])
    assert r.exit_code == 2 and "awq:w4a16" in r.output
    r = CliRunner().invoke(main, ["whatif", str(trace), "--scheme", "awq:w4a16-g64",
                                  "--engine", "vllm", "--vllm-python", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "not an executable" in r.output
