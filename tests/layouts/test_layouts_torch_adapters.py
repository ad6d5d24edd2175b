"""The torch adapters: `can_take(module) -> reason` ("" when they can), the dense weight on the
layer's device and dtype, and the detector on a live layer. Expectations come from integers the
test packs by hand with the published AWQ rule."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from qforensics.layouts.torch_adapters import (  # noqa: E402
    ADAPTERS, AwqModule, CompressedModule, Fp8Module, GptqModule, detect_module, to_numpy)


class WQLinear_GEMM(torch.nn.Module):  # noqa: N801 - AutoAWQ's class name
    def __init__(self, qweight, qzeros, scales):
        super().__init__()
        self.w_bit = 4
        self.register_buffer("qweight", qweight)
        self.register_buffer("qzeros", qzeros)
        self.register_buffer("scales", scales)


def _awq_layer(k=32, n=16, g=16, seed=0):
    rng = np.random.default_rng(seed)
    q, z = rng.integers(0, 16, (k, n)), rng.integers(0, 16, (k // g, n))
    s = (rng.random((k // g, n)) * 0.1 + 0.01).astype(np.float16)

    def words(v):
        out = np.zeros((v.shape[0], v.shape[1] // 8), np.int64)
        for c in range(v.shape[1] // 8):
            for i, col in enumerate((0, 2, 4, 6, 1, 3, 5, 7)):
                out[:, c] |= v[:, 8 * c + col] << (4 * i)
        return torch.from_numpy(out.astype(np.uint32).view(np.int32))

    expect = (q - np.repeat(z, g, 0)) * np.repeat(s.astype(np.float64), g, 0)  # [K, N]
    return WQLinear_GEMM(words(q), words(z), torch.from_numpy(s)), expect


def test_awq_adapter_takes_and_decodes():
    layer, expect = _awq_layer()
    assert AwqModule.can_take(layer) == ""
    w = AwqModule.dense_weight(layer, torch.bfloat16)
    assert w.dtype == torch.bfloat16 and tuple(w.shape) == (16, 32)
    np.testing.assert_allclose(AwqModule.dense_weight(layer, torch.float32).numpy(), expect.T, rtol=1e-6)
    assert detect_module(layer).name == "awq-gemm"


def test_refusals_say_why():
    plain = torch.nn.Linear(8, 4)
    assert AwqModule.can_take(plain) == "not a WQLinear"
    assert GptqModule.can_take(plain) == "not a GPTQ layer"
    assert CompressedModule.can_take(plain) == "not a compressed-tensors packed layer"
    assert Fp8Module.can_take(plain) == "not an FP8 weight"
    layer, _ = _awq_layer()
    layer.scales = layer.scales[:, :8]  # N no longer matches the packed columns
    assert "do not match N=16" in AwqModule.can_take(layer)
    assert detect_module(plain).name == "dense"
    assert set(ADAPTERS) == {"awq-gemm", "gptq", "ct-pack-quantized", "fp8"}


def test_fp8_adapter_block_scales():
    w = torch.tensor([[1.0, 2.0, -4.0], [0.5, 448.0, 0.0]]).to(torch.float8_e4m3fn)
    lin = torch.nn.Linear(3, 2, bias=False)
    lin.weight = torch.nn.Parameter(w, requires_grad=False)
    lin.weight_scale_inv = torch.tensor([[2.0, 3.0]])  # blocks [2, 2]: columns 0-1, then 2
    lin.weight_block_size = [2, 2]
    assert Fp8Module.can_take(lin) == ""
    got = Fp8Module.dense_weight(lin, torch.float32)
    assert torch.equal(got, torch.tensor([[2.0, 4.0, -12.0], [1.0, 896.0, 0.0]]))
    assert to_numpy(w).dtype == np.uint8 and detect_module(lin).name == "fp8"
