"""vLLM's CPU W4A16 kernel under judgement, on weights repacked by vLLM's own loading code.

Runs where vLLM imports (the `vllm` marker: scripts/run-tests.sh runs these in the vLLM venv).
The reference is dequantized here from the AWQ checkpoint layout, independently of the adapter.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
from replay_helpers import make_awq

from qforensics.replay import awq
from qforensics.replay.build import build_bundle
from qforensics.replay.judge import judge_numeric
from qforensics.replay.torch_kernels import KERNELS
from qforensics.replay.verdict import Verdict

pytestmark = pytest.mark.vllm


def _vllm_repack(snap: dict[str, np.ndarray], monkeypatch) -> dict[str, np.ndarray]:
    """The tensors a vLLM CPU AWQ layer holds after process_weights_after_loading, made by vLLM."""
    import torch
    import vllm.model_executor.parameter as vparam

    # on AMX CPUs vLLM defaults to its W4A8 path (blocked layout, int8 activations); this test is about W4A16
    monkeypatch.setenv("VLLM_CPU_INT4_W4A8", "0")
    # one process, no tensor parallelism: rank 0 of 1 (vLLM's parameters ask the TP group)
    monkeypatch.setattr(vparam, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(vparam, "get_tensor_model_parallel_world_size", lambda: 1)
    from vllm.model_executor.kernels.linear.mixed_precision.cpu import CPUWNA16LinearKernel
    from vllm.model_executor.layers.quantization.auto_awq import _convert_awq_to_standard_format
    from vllm.scalar_type import scalar_types

    from vllm.model_executor.parameter import GroupQuantScaleParameter

    layer = torch.nn.Module()
    for name in ("qweight", "qzeros"):
        layer.register_parameter(name, torch.nn.Parameter(torch.from_numpy(snap[name].copy()), requires_grad=False))
    layer.register_parameter("scales", GroupQuantScaleParameter(
        data=torch.from_numpy(snap["scales"].astype(np.float32)).to(torch.bfloat16), input_dim=0, output_dim=1,
        weight_loader=lambda *a, **k: None))
    layer.bias = None
    # what AutoAWQ's vLLM linear method does after loading on CPU: AWQ -> standard format, then the kernel's repack
    _convert_awq_to_standard_format(layer, "qweight", "qzeros", 4)
    kernel = types.SimpleNamespace(
        w_q_name="qweight", w_s_name="scales", w_zp_name="qzeros",
        config=types.SimpleNamespace(weight_type=scalar_types.uint4, zero_points=True, act_type=torch.bfloat16))
    for method in ("_process_gptq_weights_w4a16", "_process_gptq_weights_w4a8"):
        setattr(kernel, method, types.MethodType(getattr(CPUWNA16LinearKernel, method), kernel))
    CPUWNA16LinearKernel.process_weights_after_loading(kernel, layer)
    assert not layer.use_w4a8, "this CPU took vLLM's W4A8 path; the W4A16 layout is not what it holds"
    return {"qweight": layer.qweight.data.numpy(), "qzeros": layer.qzeros.data.numpy(),
            "scales": layer.scales.data.float().numpy()}


def test_vllm_cpu_wna16_on_vllm_repacked_weights_and_an_inf_scale_is_data(monkeypatch):
    snap = make_awq(8, 64, 256, 128)
    snap["scales"] = snap["scales"].astype(np.float32)
    snap["input.0"] = snap["input.0"].astype(np.float32)
    held = _vllm_repack(snap, monkeypatch)
    meta = {"layout": "vllm-cpu-w4a16", "group_size": 128, "kernel": "vllm-cpu-wna16", "compute_dtype": "bfloat16"}
    b = build_bundle({"input.0": snap["input.0"], **held}, meta)
    import torch

    s_bf16 = torch.from_numpy(snap["scales"]).to(torch.bfloat16).float().numpy()  # what the layer holds
    w = awq.dequantize(snap["qweight"], snap["qzeros"], s_bf16, 128)  # from the checkpoint layout
    np.testing.assert_array_equal(b.layout.weight_kn(b.tensors, b.meta), w)
    kern = KERNELS["vllm-cpu-wna16"]
    assert kern.can_run(b.tensors, b.meta, b.layout) == (True, "vllm._custom_ops.cpu_gemm_wna16")
    res = judge_numeric(b, kern.run(b.tensors, b.meta, b.layout), "vllm-cpu-wna16")
    assert res.verdict is Verdict.NOT_REPRODUCED, res.line()

    bad = dict(held)
    bad["scales"] = held["scales"].copy()
    bad["scales"][1, 37] = np.inf  # group 1 (rows 128..255), output column 37
    b2 = build_bundle({"input.0": snap["input.0"], **bad}, meta)
    res2 = judge_numeric(b2, kern.run(b2.tensors, b2.meta, b2.layout), "vllm-cpu-wna16")
    assert res2.verdict is Verdict.DATA, res2.line()
    facts = res2.details["facts"]["nonfinite_weight"]
    assert facts["groups"] == [1] and facts["output_columns"] == [37]
    assert "scales holds non-finite values" in res2.summary
