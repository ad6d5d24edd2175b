"""Capture records each GEMM layer's layout as qforensics.layouts' detector names it on the live
layer (/modules/info `layout`), and the trace's readers take that name. The layers: a plain
Linear (a float weight: ``dense``), bitsandbytes' real 4-bit Linear (``bitsandbytes-nf4``) and a
Linear whose weight is stored as float8_e4m3fn with a per-tensor scale (``fp8``)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import qforensics
from qforensics.trace.moduleinfo import read_module_infos


class Fp8Linear(nn.Module):
    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        w = torch.randn(n, k)
        scale = w.abs().max() / 448.0
        self.weight = nn.Parameter((w / scale).to(torch.float8_e4m3fn), requires_grad=False)
        self.weight_scale = nn.Parameter(scale.reshape(()), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.weight.float() * self.weight_scale).t()


def test_each_gemm_layer_carries_the_detectors_layout(tmp_path):
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    nf4 = bnb.nn.Linear4bit(64, 64, bias=False, quant_type="nf4", compute_dtype=torch.float32,
                            compress_statistics=False)
    nf4.weight = bnb.nn.Params4bit(torch.randn(64, 64) * 0.05, requires_grad=False,
                                   quant_type="nf4", compress_statistics=False)
    model = nn.Sequential(nn.Linear(64, 64), nf4.to("cpu"),  # quantized on the move
                          Fp8Linear(64, 64))
    path = tmp_path / "t.h5"
    names = ["0", "1", "2"]
    with qforensics.capture(model, path, modules=names), torch.no_grad():
        model(torch.randn(2, 64))
    with qforensics.open_trace(path) as t:
        rows = {n: json.loads(i) for n, i in zip(t.module_columns["name"],
                                                  t.module_columns["info"]) if i}
        infos = read_module_infos(t)
    got = {n: rows[n].get("layout") for n in names}
    assert got == {"0": "dense", "1": "bitsandbytes-nf4", "2": "fp8"}
    assert {n: infos.layouts.get(n) for n in names} == got
