"""Cost of the guard's per-layer fallbacks on a SmolLM2-sized layer (down_proj: K=1536, N=576).

    python bench/guard_fallbacks.py [--repeats 5] [--tokens 64]

For each quantized layout: the one-off cost of a trip (dequantizing the packed weight once, to
the activation dtype), the memory the dense weight then holds next to the packed one, and the
time of one dense fallback call on --tokens rows, next to a plain float32 F.linear. The packed
tensors are random (the values do not change the cost). Medians of --repeats runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from qforensics.guard.fallbacks import choose_fallback
from qforensics.guard.policy import GuardPolicy

K, N, G = 1536, 576, 128


class WQLinear_GEMM(nn.Module):  # noqa: N801 - AutoAWQ's class name, matched by the guard
    def __init__(self) -> None:
        super().__init__()
        self.w_bit = 4
        self.register_buffer("qweight", torch.randint(-2**31, 2**31 - 1, (K, N // 8),
                                                      dtype=torch.int32))
        self.register_buffer("qzeros", torch.randint(-2**31, 2**31 - 1, (K // G, N // 8),
                                                     dtype=torch.int32))
        self.register_buffer("scales", torch.rand(K // G, N).half())


class QuantLinear(nn.Module):  # GPTQ, act-order
    def __init__(self) -> None:
        super().__init__()
        self.bits = 4
        self.register_buffer("qweight", torch.randint(-2**31, 2**31 - 1, (K // 8, N),
                                                      dtype=torch.int32))
        self.register_buffer("qzeros", torch.randint(-2**31, 2**31 - 1, (K // G, N // 8),
                                                     dtype=torch.int32))
        self.register_buffer("scales", torch.rand(K // G, N).half())
        self.register_buffer("g_idx", (torch.arange(K) // G)[torch.randperm(K)].int())


def _compressed() -> nn.Module:
    m = nn.Module()
    m.register_buffer("weight_packed", torch.randint(-2**31, 2**31 - 1, (N, K // 8),
                                                     dtype=torch.int32))
    m.register_buffer("weight_scale", torch.rand(N, K // G))
    m.register_buffer("weight_shape", torch.tensor([N, K]))
    return m


def _fp8() -> nn.Module:
    m = nn.Module()
    m.weight = nn.Parameter(torch.randn(N, K).to(torch.float8_e4m3fn), requires_grad=False)
    m.weight_scale = nn.Parameter(torch.rand(N, 1), requires_grad=False)
    m.input_scale = nn.Parameter(torch.tensor(0.05), requires_grad=False)
    return m


def _bnb4() -> nn.Module:
    import bitsandbytes as bnb

    layer = bnb.nn.Linear4bit(K, N, bias=False, quant_type="nf4", compute_dtype=torch.float32)
    layer.weight = bnb.nn.Params4bit(torch.randn(N, K) * 0.05, requires_grad=False,
                                     quant_type="nf4")
    return layer.to("cpu")


def _bytes(m: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*m.parameters(), *m.buffers()))


def _median(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.tokens, K)
    w = torch.randn(N, K)
    dense = _median(lambda: F.linear(x, w), args.repeats)
    print(f"layer K={K} N={N}, {args.tokens} tokens; float32 F.linear: {dense * 1e3:.2f} ms")
    print(f"{'layout':<36}{'dequantize once':>16}{'packed':>10}{'dense':>10}{'call':>10}")
    for make in (WQLinear_GEMM, QuantLinear, _compressed, _fp8, _bnb4):
        layer = make()
        fb, why = choose_fallback("layer", layer, GuardPolicy())
        assert fb is not None, why
        t_deq = _median(lambda: fb.dense_weight(torch.float32), args.repeats)
        wd = fb.weight_for(torch.float32)
        t_call = _median(lambda: fb(x, torch.float32), args.repeats)
        print(f"{fb.layout:<36}{t_deq * 1e3:>13.2f} ms{_bytes(layer) / 2**20:>7.2f} MiB"
              f"{wd.numel() * wd.element_size() / 2**20:>7.2f} MiB{t_call * 1e3:>7.2f} ms")


if __name__ == "__main__":
    main()
