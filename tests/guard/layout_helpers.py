"""Quantized layers in each library's published layout, built from integers the test chooses,
and the dequantization written out from the published format (never from the guard's code).

Each ``make_*`` returns (module, expected dense weight [N, K] in float32). The expected weight
comes from the chosen integers and scales directly, so it never goes through an unpacker.
Layers whose library does not install here get a forward that runs the layer's GEMM the way a
half-precision kernel does (float16 accumulation), so an outlier input overflows to Inf.
"""

from __future__ import annotations

import torch
from torch import nn

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
# bitsandbytes' NF4 code book (QLoRA, Dettmers et al. 2023, appendix E).
NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
       -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
       0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
       0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]


def _word(nibbles: list[int]) -> int:
    """Eight 4-bit values into one int32, value i in bits [4i, 4i+4) (two's complement)."""
    v = 0
    for i, nb in enumerate(nibbles):
        v |= (int(nb) & 0xF) << (4 * i)
    return v - (1 << 32) if v >= 1 << 31 else v


def fp16_kernel(x: torch.Tensor, w_nk: torch.Tensor) -> torch.Tensor:
    """What a half-precision GEMM kernel returns: float16 operands and accumulator."""
    return (x.half() @ w_nk.half().t()).to(x.dtype)


class WQLinear_GEMM(nn.Module):  # noqa: N801 - AutoAWQ's class name
    """AutoAWQ's GEMM layer layout (autoawq does not install on torch 2.13 / CPU)."""

    def __init__(self, qweight, qzeros, scales, group_size, expected):
        super().__init__()
        self.w_bit, self.group_size = 4, group_size
        self.in_features, self.out_features = qweight.shape[0], scales.shape[1]
        self.register_buffer("qweight", qweight)
        self.register_buffer("qzeros", qzeros)
        self.register_buffer("scales", scales)
        self.bias = None
        self._w = expected  # the kernel stand-in uses the test's own dense weight

    def forward(self, x):
        return fp16_kernel(x, self._w)


class QuantLinear(nn.Module):
    """GPTQ's QuantLinear layout (auto-gptq / gptqmodel build CUDA extensions: not here)."""

    def __init__(self, bits, group_size, qweight, qzeros, scales, g_idx, expected):
        super().__init__()
        self.bits, self.group_size = bits, group_size
        self.register_buffer("qweight", qweight)
        self.register_buffer("qzeros", qzeros)
        self.register_buffer("scales", scales)
        self.register_buffer("g_idx", g_idx)
        self.bias = None
        self._w = expected

    def forward(self, x):
        return fp16_kernel(x, self._w)


def make_awq(n=64, k=128, g=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(0, 16, (k // g, n), generator=gen)
    s = (torch.rand(k // g, n, generator=gen) * 0.02 + 0.005).half()
    qweight = torch.tensor([[_word([q[r, j * 8 + AWQ_ORDER[i]] for i in range(8)])
                             for j in range(n // 8)] for r in range(k)], dtype=torch.int32)
    qzeros = torch.tensor([[_word([z[r, j * 8 + AWQ_ORDER[i]] for i in range(8)])
                            for j in range(n // 8)] for r in range(k // g)], dtype=torch.int32)
    expected = torch.empty(n, k)
    for kk in range(k):
        for nn_ in range(n):
            expected[nn_, kk] = (q[kk, nn_] - z[kk // g, nn_]) * float(s[kk // g, nn_])
    return WQLinear_GEMM(qweight, qzeros, s, g, expected), expected


def make_gptq(n=64, k=128, g=32, seed=1, act_order=True):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(1, 16, (k // g, n), generator=gen)  # stored as z - 1 (v1 format)
    s = (torch.rand(k // g, n, generator=gen) * 0.02 + 0.005).half()
    g_idx = torch.arange(k) // g
    if act_order:  # act-order: rows are grouped by a permutation, not by position
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    qweight = torch.tensor([[_word([q[r * 8 + i, c] for i in range(8)]) for c in range(n)]
                            for r in range(k // 8)], dtype=torch.int32)
    qzeros = torch.tensor([[_word([z[r, c * 8 + i] - 1 for i in range(8)])
                            for c in range(n // 8)] for r in range(k // g)], dtype=torch.int32)
    expected = torch.empty(n, k)
    for kk in range(k):
        gi = int(g_idx[kk])
        for nn_ in range(n):
            expected[nn_, kk] = float(s[gi, nn_]) * (q[kk, nn_] - z[gi, nn_])
    return QuantLinear(4, g, qweight, qzeros, s, g_idx.int(), expected), expected


def make_compressed_tensors(n=64, k=128, g=32, seed=2):
    """A real compressed-tensors W4A16 (group, symmetric) layer: an nn.Linear the library's
    own `compress_module` packs into ``weight_packed`` / ``weight_scale`` / ``weight_shape``."""
    from compressed_tensors.compressors import compress_module
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig,
                                                 QuantizationScheme, apply_quantization_config)

    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=gen)
    s = torch.rand(n, k // g, generator=gen) * 0.02 + 0.005
    expected = q.float() * s.repeat_interleave(g, 1)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=g))
    holder = nn.Sequential(nn.Linear(k, n, bias=False))
    apply_quantization_config(holder, QuantizationConfig(config_groups={"w4a16": scheme},
                                                         format="pack-quantized"))
    lin = holder[0]
    with torch.no_grad():
        lin.weight.copy_(expected)
        lin.weight_scale.copy_(s)
    compress_module(lin)
    assert not hasattr(lin, "weight") and hasattr(lin, "weight_packed")
    return lin, expected


class CompressedKernel(nn.Module):
    """Runs a compressed-tensors packed layer the way a W4A16 GPU kernel does (the library
    itself has no CPU forward for packed weights); the packed layer is its child ``inner``."""

    def __init__(self, inner: nn.Module, expected: torch.Tensor):
        super().__init__()
        self.inner = inner
        self._w = expected

    def forward(self, x):
        return self.inner(x)

    def attach_kernel(self):
        w = self._w
        self.inner.forward = lambda x: fp16_kernel(x, w)  # the test's stand-in kernel
        return self


class FP8Linear(nn.Module):
    """An FP8 layer: float8_e4m3fn weight, ``weight_scale`` (tensor, channel or block), optional
    static ``input_scale``. Its kernel quantizes the activation WITHOUT saturation, as the
    no-saturation FP8 path does: a value beyond ±448 after scaling becomes NaN."""

    def __init__(self, weight8, weight_scale, input_scale=None, block=None):
        super().__init__()
        self.weight = nn.Parameter(weight8, requires_grad=False)
        self.weight_scale = nn.Parameter(weight_scale, requires_grad=False)
        if input_scale is not None:
            self.input_scale = nn.Parameter(input_scale, requires_grad=False)
        if block is not None:
            self.weight_block_size = list(block)
        self.bias = None

    def forward(self, x):
        s = self.input_scale if hasattr(self, "input_scale") else \
            x.abs().amax(-1, keepdim=True) / 448.0
        xs = x / s
        xq = torch.where(xs.abs() > 448.0, torch.full_like(xs, float("nan")),
                         xs.to(torch.float8_e4m3fn).float())
        return (xq * s) @ expected_fp8(self).t()


def expected_fp8(layer: FP8Linear) -> torch.Tensor:
    """W = float8 weight x its scale, scale expanded by hand (tensor / channel / block)."""
    w = layer.weight.float()
    n, k = w.shape
    sc = layer.weight_scale.float()
    out = torch.empty(n, k)
    if sc.numel() == 1:
        return w * float(sc.reshape(()))
    if sc.dim() == 1 or sc.shape[1] == 1:
        return w * sc.reshape(n, 1)
    bn, bk = layer.weight_block_size
    for i in range(n):
        for j in range(k):
            out[i, j] = w[i, j] * sc[i // bn, j // bk]
    return out


def make_fp8(n=64, k=128, scale="channel", static_input=True, seed=3):
    gen = torch.Generator().manual_seed(seed)
    w8 = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    if scale == "tensor":
        ws = torch.tensor(0.0004)
        block = None
    elif scale == "channel":
        ws = torch.rand(n, 1, generator=gen) * 0.0004 + 0.0001
        block = None
    else:
        block = (32, 64)
        ws = torch.rand((n + 31) // 32, (k + 63) // 64, generator=gen) * 0.0004 + 0.0001
    layer = FP8Linear(w8, ws, torch.tensor(0.02) if static_input else None, block)
    return layer, expected_fp8(layer)


def nf4_dequant(layer) -> torch.Tensor:
    """bitsandbytes NF4 (compress_statistics=False) by hand: two codes per byte, the first in
    the high nibble; code book NF4; one float32 absmax per ``blocksize`` values, row-major."""
    qs = layer.weight.quant_state
    data = layer.weight.data.reshape(-1).tolist()
    codes = []
    for byte in data:
        codes += [byte >> 4, byte & 0xF]
    n, k = qs.shape
    absmax = qs.absmax.float().tolist()
    vals = [NF4[c] * absmax[i // qs.blocksize] for i, c in enumerate(codes[: n * k])]
    return torch.tensor(vals).reshape(n, k)


def make_bnb4(n=64, k=128, compute_dtype=torch.float16, seed=4):
    import bitsandbytes as bnb

    gen = torch.Generator().manual_seed(seed)
    layer = bnb.nn.Linear4bit(k, n, bias=False, quant_type="nf4", compute_dtype=compute_dtype,
                              compress_statistics=False)
    layer.weight = bnb.nn.Params4bit(torch.randn(n, k, generator=gen) * 0.05,
                                     requires_grad=False, quant_type="nf4",
                                     compress_statistics=False)
    layer = layer.to("cpu")  # bitsandbytes quantizes on the move to the device
    return layer, nf4_dequant(layer)


def make_bnb8(n=64, k=128, seed=5):
    import bitsandbytes as bnb

    gen = torch.Generator().manual_seed(seed)
    layer = bnb.nn.Linear8bitLt(k, n, bias=False, has_fp16_weights=False)
    layer.weight = bnb.nn.Int8Params(torch.randn(n, k, generator=gen) * 0.05,
                                     requires_grad=False, has_fp16_weights=False)
    layer = layer.to("cpu")
    cb = layer.weight.CB.float()
    scb = layer.weight.SCB.float()
    expected = torch.empty(n, k)
    for i in range(n):  # LLM.int8 row-wise absmax: W = CB * SCB / 127
        expected[i] = cb[i] * (scb[i] / 127.0)
    return layer, expected


class Tiny(nn.Module):
    """embedding-free toy LM: dense in-projection, the quantized layer under test, dense head."""

    def __init__(self, layer: nn.Module, k: int, n: int, vocab: int = 50):
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        self.up = nn.Linear(16, k)
        self.q = layer
        self.head = nn.Linear(n, vocab)
        with torch.no_grad():
            for p in (self.up.weight, self.up.bias, self.head.weight, self.head.bias):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)

    def forward(self, x):
        return self.head(torch.relu(self.q(self.up(x))))
