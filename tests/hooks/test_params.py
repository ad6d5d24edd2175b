"""Parameter evidence captured at attach (qforensics.hooks.params, describe_module): every
expectation is set up by the test itself (the row it corrupts, the levels it builds)."""

from __future__ import annotations

import json

import torch
from torch import nn

from qforensics.hooks.modules import describe_module, select_modules
from qforensics.hooks.params import param_health, static_input, tied_groups


def test_nan_row_and_inf_scale_group_are_located():
    w = torch.randn(64, 256)
    w[37, 200] = float("nan")
    w[50, 3] = float("inf")
    h = param_health(w, "weight", group=128)
    assert (h["nan"], h["inf"]) == (1, 1)
    assert h["first_nonfinite"] == {"index": 37 * 256 + 200, "row": 37, "col": 200, "group": 1}
    scales = torch.rand(4, 512) + 0.1  # AWQ layout [K / group, N]
    scales[2, 99] = float("inf")
    scales[3, 7] = 0.0
    hs = param_health(scales, "scales")
    assert hs["inf"] == 1
    assert (hs["first_nonfinite"]["row"], hs["first_nonfinite"]["col"]) == (2, 99)
    assert hs["zero"] == 1 and hs["first_zero"]["row"] == 3 and hs["first_zero"]["col"] == 7
    assert "group" not in hs["first_nonfinite"]  # a scale's own (row, col) is its group


def test_levels_and_dominance_on_weights_built_by_the_test():
    torch.manual_seed(0)
    dense = torch.randn(64, 256)
    d = param_health(dense, "weight", group=128, summarize=True)["levels"]
    assert d["levels_min"] == 128 and d["dominated_share"] < 0.1
    ternary = torch.randint(-1, 2, (64, 256)).float() * 0.02  # {-s, 0, s} in every group
    t = param_health(ternary, "weight", group=128, summarize=True)["levels"]
    assert t["levels_median"] == 3 and t["levels_min"] <= 3
    spiky = torch.randn(64, 256) * 0.01
    spiky[:, ::128] = 1.0  # one weight per group at 100x the rest
    s = param_health(spiky, "weight", group=128, summarize=True)["levels"]
    assert s["dominated_share"] == 1.0 and s["groups"] == 32 * 2


def test_zero_points_out_of_range():
    zp = torch.tensor([[0, 3, 15], [16, 2, -9]], dtype=torch.int32)
    h = param_health(zp, "weight_zero_point", bits=4)
    assert h["zero_point_out_of_range"] == 2  # 16 > 15 and -9 < -8
    assert h["first_out_of_range"]["row"] == 1 and h["first_out_of_range"]["col"] == 0


class _FP8Layer(nn.Module):
    """A compressed-tensors / vLLM style FP8 W8A8 layer: float8 weight, weight_scale and a
    static per-tensor input_scale."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 16).to(torch.float8_e4m3fn), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.tensor(0.5), requires_grad=False)
        self.input_scale = nn.Parameter(torch.tensor(0.25), requires_grad=False)


def test_static_input_scale_and_its_range():
    layer = _FP8Layer()
    st = static_input(layer, {"format": "fp8-e4m3", "bits": 8})
    assert st["format"] == "fp8-e4m3" and st["range"] == 0.25 * 448
    int8 = nn.Linear(4, 4)
    int8.input_scale = torch.tensor(0.5)  # plain attribute, as some loaders leave it
    assert static_input(int8, {"format": "int8"})["range"] == 0.5 * 127
    assert static_input(nn.Linear(4, 4), None) is None


def test_asymmetric_int8_input_range_follows_the_zero_point():
    # INT8 with zero point z quantizes x to round(x / s) + z in [-128, 127], so the inputs it
    # represents are s x (-128 - z) .. s x (127 - z)
    layer = nn.Linear(4, 4)
    layer.weight = nn.Parameter(torch.ones(4, 4, dtype=torch.int8), requires_grad=False)
    layer.input_scale = torch.tensor(0.01)
    layer.input_zero_point = torch.tensor(4, dtype=torch.int32)
    st = static_input(layer, None)
    assert st["format"] == "int8" and st["zero_point"] == 4
    assert abs(st["lo"] - 0.01 * -132) < 1e-6 and abs(st["hi"] - 0.01 * 123) < 1e-6
    assert abs(st["range"] - 1.32) < 1e-6 and st["applied"] is True


class _Kernel:
    """Stands in for an engine kernel object: only its class name and `linear_method` are read."""

    def __init__(self, name: str, method: str | None = None) -> None:
        self.__class__ = type(name, (_Kernel,), {})
        if method:
            def _fn() -> None:
                return None
            _fn.__name__ = method
            self.linear_method = _fn


def test_a_kernel_that_does_not_apply_the_static_scale_is_said_so():
    layer = _FP8Layer()
    layer.scheme = type("Scheme", (), {})()
    layer.scheme.fp8_linear = _Kernel("CPUFp8PerTensorScaledMMLinearKernel")
    st = static_input(layer, None)
    assert st["applied"] is False and "W8A16" in st["why"]
    int8 = nn.Linear(4, 4)
    int8.input_scale = torch.tensor(0.5)
    int8.scheme = type("Scheme", (), {})()
    int8.scheme.kernel = _Kernel("CPUInt8ScaledMMLinearKernel", "_apply_weights_sgl")
    st = static_input(int8, {"format": "int8"})
    assert st["applied"] is False and st["kernel"].endswith("apply_weights_sgl")
    int8.scheme.kernel = _Kernel("CPUInt8ScaledMMLinearKernel", "_apply_weights_onednn")
    assert static_input(int8, {"format": "int8"})["applied"] is True


def test_symmetric_int8_is_told_by_its_kernel_when_nothing_else_says_int8():
    """vLLM's symmetric static INT8 layer: no zero point, no format hint, and after oneDNN's
    repack no int8 `weight` either; its kernel's class says INT8, so the range is scale x 127
    (INT8's largest level), not FP8's 448."""
    layer = nn.Linear(4, 4)
    layer.weight = nn.Parameter(torch.zeros(0, dtype=torch.bfloat16), requires_grad=False)
    layer.input_scale = torch.tensor(0.01)
    layer.scheme = type("CompressedTensorsW8A8Int8", (), {})()
    layer.scheme.kernel = _Kernel("CPUInt8ScaledMMLinearKernel", "_apply_weights_onednn")
    st = static_input(layer, None)
    assert st["format"] == "int8" and abs(st["range"] - 0.01 * 127) < 1e-6
    assert st["applied"] is True and "zero_point" not in st
    fp8 = nn.Linear(4, 4)  # an FP8 kernel is not mistaken for INT8
    fp8.input_scale = torch.tensor(0.01)
    fp8.scheme = type("CompressedTensorsW8A8Fp8", (), {})()
    fp8.scheme.fp8_linear = _Kernel("TorchFP8ScaledMMLinearKernel")
    assert static_input(fp8, None)["format"] == "fp8-e4m3"


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.body = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, 32, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.body(self.embed(ids)))


def test_tied_weights_are_named_on_the_root_row():
    m = _Tied()
    assert tied_groups(m) == [["embed.weight", "lm_head.weight"]]
    rows = {r["name"]: json.loads(r["info"]) for r in
            (describe_module(n, mod, k) for n, mod, k in select_modules(m))}
    assert rows[""]["tied"] == [["embed.weight", "lm_head.weight"]]
    assert rows["lm_head"]["health"]["weight"]["numel"] == 32 * 8


def test_weight_changed_through_data_between_attaches_is_recounted():
    m = _Tied()
    describe = lambda: {r["name"]: json.loads(r["info"]) for r in
                        (describe_module(n, mod, k) for n, mod, k in select_modules(m))}
    assert describe()["body"]["health"]["weight"]["nan"] == 0
    m.body.weight.data[3, 1] = float("nan")  # .data does not bump the version counter
    h = describe()["body"]["health"]["weight"]
    assert h["nan"] == 1 and h["first_nonfinite"]["row"] == 3


def _pack_gptq(codes: torch.Tensor) -> torch.Tensor:
    """[K, N] 4-bit codes -> GPTQ qweight [K / 8, N] (8 codes per int32 along K)."""
    k, n = codes.shape
    c = codes.reshape(k // 8, 8, n).to(torch.int64)
    packed = sum(c[:, j] << (4 * j) for j in range(8))
    return (packed - (packed >= 2 ** 31).long() * 2 ** 32).to(torch.int32)


def _pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """[K, N] 4-bit codes -> AWQ-style qweight [K, N / 8] (8 codes per int32 along N)."""
    k, n = codes.shape
    c = codes.reshape(k, n // 8, 8).to(torch.int64)
    packed = sum(c[..., j] << (4 * j) for j in range(8))
    return (packed - (packed >= 2 ** 31).long() * 2 ** 32).to(torch.int32)


class QuantLinear(nn.Module):  # GPTQ's class name
    def __init__(self, codes: torch.Tensor, group: int) -> None:
        super().__init__()
        self.register_buffer("qweight", _pack_gptq(codes))
        self.register_buffer("scales", torch.ones(codes.shape[0] // group, codes.shape[1]))


class WQLinear_GEMM(nn.Module):  # AutoAWQ's class name
    def __init__(self, codes: torch.Tensor, group: int) -> None:
        super().__init__()
        self.register_buffer("qweight", _pack_awq(codes))
        self.register_buffer("scales", torch.ones(codes.shape[0] // group, codes.shape[1]))


def test_levels_of_packed_gptq_and_awq_weights():
    torch.manual_seed(0)
    k, n, g = 256, 64, 128
    healthy = torch.randint(0, 16, (k, n))
    two = torch.where(torch.rand(k, n) < 0.5, 7, 8)  # only two codes in every group
    for cls in (QuantLinear, WQLinear_GEMM):
        for codes, want in ((healthy, 16), (two, 2)):
            info = json.loads(describe_module("m", cls(codes, g), "quantized_linear")["info"])
            assert info["quant"]["group_size"] == g
            lv = info["health"]["qweight"]["levels"]
            # independent: distinct codes per (group, column) of the sampled columns
            exp = [len(set(codes[i:i + g, j].tolist())) for i in range(0, k, g) for j in range(n)]
            assert lv["levels_median"] == want == sorted(exp)[len(exp) // 2], cls.__name__
