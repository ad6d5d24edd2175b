"""The torch kernels under judgement on CPU, against the float64 reference: clean data agrees,
an Inf group scale (corrupted here, so its group and column are known) is DATA naming them."""

from __future__ import annotations

import numpy as np
import pytest
from replay_helpers import make_awq

from qforensics.replay.build import build_bundle
from qforensics.replay.judge import judge_numeric
from qforensics.replay.torch_kernels import KERNELS
from qforensics.replay.verdict import Verdict

K, N, G = 256, 64, 128


@pytest.mark.parametrize("kernel", ["torch-int4pack", "torch-compile"])
def test_int4_kernels_agree_and_name_a_corrupted_group(kernel):
    snap = make_awq(8, N, K, G)
    b = build_bundle(snap, {"group_size": G})
    ok, why = KERNELS[kernel].can_run(b.tensors, b.meta, b.layout)
    assert ok, why
    assert judge_numeric(b, KERNELS[kernel].run(b.tensors, b.meta, b.layout), kernel).verdict is Verdict.NOT_REPRODUCED
    snap["scales"] = snap["scales"].astype(np.float32)
    snap["scales"][1, 5] = np.inf  # group 1 (rows 128..255), output column 5
    bad = build_bundle(snap, {"group_size": G})
    res = judge_numeric(bad, KERNELS[kernel].run(bad.tensors, bad.meta, bad.layout), kernel)
    assert res.verdict is Verdict.DATA, res.line()
    facts = res.details["facts"]["nonfinite_weight"]
    assert facts["groups"] == [1] and facts["output_columns"] == [5]


def test_a_kernel_that_cannot_take_a_layout_says_why():
    b = build_bundle(make_awq(8, N, K, G), {"group_size": G})
    ok, why = KERNELS["torch-scaled-mm"].can_run(b.tensors, b.meta, b.layout)
    assert not ok and "fp8 layout" in why
    ok, why = KERNELS["vllm-cpu-wna16"].can_run(b.tensors, b.meta, b.layout)
    assert not ok and "this layout is awq-gemm" in why
