"""The detector names each layout once, from what a trace records (dtype and shape per tensor)."""

from __future__ import annotations

import numpy as np

from qforensics.layouts import FORMATS, detect
from qforensics.layouts.detect import packed_method


def _p(**specs):
    return {k: {"dtype": dt, "shape": list(shape)} for k, (dt, shape) in specs.items()}


def test_names_from_trace_params():
    awq = _p(qweight=("int32", (64, 2)), qzeros=("int32", (2, 2)), scales=("float16", (2, 16)))
    assert detect(awq, "WQLinear_GEMM").name == "awq-gemm"
    assert detect(awq).name == "awq-gemm"  # from the shapes alone
    gptq = _p(qweight=("int32", (8, 16)), qzeros=("int32", (2, 2)), scales=("float16", (2, 16)),
              g_idx=("int32", (64,)))
    assert detect(gptq, "QuantLinear").name == "gptq" and detect(gptq).name == "gptq"
    assert detect(awq, method="gptq").name == "gptq"  # a config's word wins over shapes
    ct = _p(weight_packed=("int32", (16, 8)), weight_scale=("bfloat16", (16, 2)), weight_shape=("int64", (2,)))
    assert detect(ct).name == "ct-pack-quantized"
    assert detect(_p(weight=("float8_e4m3fn", (16, 64)), weight_scale=("float32", (1,)))).name == "fp8"
    assert detect(_p(weight=("int8", (16, 64)), weight_scale=("float32", (16, 1)))).name == "int8"
    assert detect(_p(weight=("bfloat16", (16, 64)))).name == "dense"
    assert detect(_p(weight=("uint8", (512, 1))), "Linear4bit").name == "bitsandbytes-nf4"
    assert detect(awq, engine_layout="vllm-cpu-w4a8").name == "vllm-cpu-w4a8"
    assert detect({}).name == ""


def test_arrays_work_too_and_every_name_is_listed():
    d = detect({"weight": np.zeros((4, 4), np.float32)})
    assert d.name == "dense" and d.why
    for params, mt in ((_p(qweight=("int32", (3, 5)), scales=("float16", (1, 7))), ""),):
        got = detect(params, mt)
        assert got.name == "" and "neither" in got.why
    assert packed_method((64, 2), (2, 16)) == "awq-gemm" and packed_method((8, 16), (2, 16)) == "gptq"
    assert {"dense", "awq-gemm", "gptq", "ct-pack-quantized", "fp8", "vllm-cpu-w4a16"} <= set(FORMATS)
