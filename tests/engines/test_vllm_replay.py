"""Replay with vLLM's own CPU W4A16 kernel under judgement: on weights repacked by vLLM's loading
code, and end to end on a real vLLM run of the AWQ checkpoint with one group scale set to +Inf.

Runs where vLLM imports (the `vllm` marker: scripts/run-tests.sh runs these in the vLLM venv).
On a CPU whose vLLM build has no W4A16 kernel (AVX2) the first test checks that replay says so;
the end-to-end one needs the kernel (`w4a16`).
Expectations come from the AWQ checkpoint layout and from the corruption the test itself names.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

from qforensics.layouts import awq
from qforensics.layouts.bits import pack_awq
from qforensics.replay.build import build_bundle
from qforensics.replay.judge import judge_numeric
from qforensics.replay.run import numeric_leg, replay
from qforensics.replay.torch_kernels import KERNELS
from qforensics.replay.verdict import Verdict
from vllm_runs import PROMPT_A, PROMPT_B, run_recorded

pytestmark = pytest.mark.vllm


def make_awq(m: int, n: int, k: int, g: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"input.0": rng.standard_normal((m, k)).astype(np.float32),
            "qweight": pack_awq(rng.integers(0, 16, (k, n))),
            "qzeros": pack_awq(rng.integers(0, 16, (k // g, n))),
            "scales": (rng.random((k // g, n)) * 0.01 + 0.001).astype(np.float32)}


def _vllm_repack(snap: dict[str, np.ndarray], monkeypatch) -> dict[str, np.ndarray]:
    """The tensors a vLLM CPU AWQ layer holds after process_weights_after_loading, made by vLLM."""
    import torch
    import vllm.model_executor.parameter as vparam

    # on AMX CPUs vLLM defaults to its W4A8 path (blocked layout, int8 activations); this test is about W4A16
    monkeypatch.setenv("VLLM_CPU_INT4_W4A8", "0")
    # one process, no tensor parallelism: rank 0 of 1 (vLLM's parameters ask the TP group)
    monkeypatch.setattr(vparam, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(vparam, "get_tensor_model_parallel_world_size", lambda: 1)
    from vllm.model_executor.kernels.linear.mixed_precision.cpu import (
        CPUWNA16LinearKernel,
    )
    from vllm.model_executor.layers.quantization.auto_awq import (
        _convert_awq_to_standard_format,
    )
    from vllm.model_executor.parameter import GroupQuantScaleParameter
    from vllm.scalar_type import scalar_types

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


def test_vllm_cpu_wna16_on_vllm_repacked_weights_and_an_inf_scale_is_data(monkeypatch, tmp_path):
    """Where this CPU's vLLM build has no W4A16 kernel, the layout still reads the weights vLLM
    repacked, and replay is INCONCLUSIVE, naming the missing kernel."""
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
    can = kern.can_run(b.tensors, b.meta, b.layout)
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # as vLLM's worker loads them
    try:  # what the worker would call: the op namespace says whether the kernel is there
        torch.ops._C.cpu_gemm_wna16
        present = True
    except AttributeError:
        present = False
    if not present:  # vllm-cpu's AVX2 build: replay says so instead of crashing in the call
        assert can[0] is False and "cpu_gemm_wna16" in can[1], can
        res, y = numeric_leg(b, kernel=None, launcher=None, work_dir=tmp_path)
        assert res.verdict is Verdict.INCONCLUSIVE and y is None
        assert "cpu_gemm_wna16" in res.summary and "vllm-cpu-wna16" in res.summary, res.line()
        return
    assert can == (True, "vllm._custom_ops.cpu_gemm_wna16")
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


@pytest.mark.w4a16
def test_replay_of_a_real_vllm_awq_run_with_an_inf_group_scale_is_data(tmp_path_factory, monkeypatch):
    """The vLLM AWQ scenario, recorded in vLLM's W4A16 path, replayed through cpu_gemm_wna16."""
    from qforensics.demo import vllm_scenarios as sc
    from qforensics.demo.vllm_checkpoints import checkpoint_dir

    monkeypatch.setenv("VLLM_CPU_INT4_W4A8", "0")  # the workers inherit it: W4A16 layout, not W4A8
    run = run_recorded(tmp_path_factory.mktemp("awq-inf-w4a16"), checkpoint_dir("awq", "inf-group-scale"),
                       [PROMPT_A, PROMPT_B], 2)
    out = replay(run["files"][0], gpu_probe=lambda: (False, "test"))
    meta = out.bundle.meta
    assert meta["module"] == sc.AWQ_INF_LAYER and meta["layout"] == "vllm-cpu-w4a16"
    assert meta["kernel"] == "vllm-cpu-wna16" and meta["compute_dtype"] == "bfloat16"
    data = out.results[0]
    assert data.verdict is Verdict.DATA, data.line()
    facts = data.details["facts"]["nonfinite_weight"]
    assert facts["groups"] == [sc.AWQ_INF_GROUP] and facts["output_columns"] == [sc.AWQ_INF_COLUMN]
    assert out.results[1].verdict is Verdict.INCONCLUSIVE  # no GPU here: never a clean sanitizer line
