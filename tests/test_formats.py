"""qforensics.formats against independent sources: numpy's and torch's own format limits, the
bit patterns of the FP8 formats, and every kind capture actually writes."""

from __future__ import annotations

import numpy as np
import torch

from qforensics import formats


def _fp8_max(exp_bits: int, man_bits: int, ieee_like: bool) -> float:
    bias = 2 ** (exp_bits - 1) - 1
    if ieee_like:  # e5m2: the all-ones exponent is Inf/NaN
        return (2 - 2.0 ** -man_bits) * 2.0 ** ((2 ** exp_bits - 2) - bias)
    # e4m3fn: all-ones exponent is finite except S.1111.111 (NaN)
    return (2 - 2 * 2.0 ** -man_bits) * 2.0 ** ((2 ** exp_bits - 1) - bias)


def test_float_limits_match_the_libraries():
    assert formats.FP16_MAX == float(np.finfo(np.float16).max)
    assert formats.BF16_MAX == float(torch.finfo(torch.bfloat16).max)
    assert formats.E4M3_MAX == float(torch.finfo(torch.float8_e4m3fn).max)
    assert formats.E5M2_MAX == float(torch.finfo(torch.float8_e5m2).max)
    assert formats.E4M3_MAX == _fp8_max(4, 3, ieee_like=False)
    assert formats.E5M2_MAX == _fp8_max(5, 2, ieee_like=True)
    for name, fmt in (("fp8-e4m3", torch.float8_e4m3fn), ("fp8-e5m2", torch.float8_e5m2)):
        tiny = formats.FP8_MIN_SUBNORMAL[name]
        assert float(torch.tensor(tiny).to(fmt).float()) == tiny
        assert float(torch.tensor(tiny / 2.1).to(fmt).float()) == 0.0
        assert formats.FORMAT_LIMITS[name] == float(torch.finfo(fmt).max)


def test_int_ranges():
    for bits in (2, 4, 8, 16):
        lo, hi = formats.int_range(bits)
        info = np.iinfo(f"int{bits}") if bits in (8, 16) else None
        if info is not None:
            assert (lo, hi) == (info.min, info.max)
        assert hi - lo + 1 == 2 ** bits and lo == -hi - 1
        assert formats.int_range(bits, signed=False) == (0, 2 ** bits - 1)
    assert formats.symmetric_qmax(4) == 7 and formats.symmetric_qmax(8) == 127


def test_capture_writes_only_known_kinds():
    from qforensics.hooks.modules import select_modules

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.act = torch.nn.GELU()

    model = torch.nn.Sequential(Block(), torch.nn.Linear(4, 2))
    kinds = {k for _, _, k in select_modules(model)} | {
        k for _, _, k in select_modules(model, ["0.act"])}
    assert kinds <= formats.MODULE_KINDS
    assert {formats.KIND_LINEAR, formats.KIND_ROOT, formats.KIND_OTHER} <= kinds
