"""vLLM's CPU W4A16 repack, checked against vLLM's own code: CPUWNA16LinearKernel's
_process_gptq_weights_w4a16 repacks a GPTQ-layout qweight, and layouts.vllm_cpu must agree."""

from __future__ import annotations

import numpy as np
import pytest

from qforensics.layouts import vllm_cpu
from qforensics.layouts.bits import pack_bits

pytestmark = pytest.mark.vllm


def test_repack_matches_vllms_own_process_weights():
    torch = pytest.importorskip("torch")
    cpu = pytest.importorskip("vllm.model_executor.kernels.linear.mixed_precision.cpu")
    from vllm.scalar_type import scalar_types

    k, n = 64, 32
    q = np.random.default_rng(0).integers(0, 16, (k, n))
    kernel = object.__new__(cpu.CPUWNA16LinearKernel)  # only the repack step runs, no platform
    kernel.config = type("Config", (), {"weight_type": scalar_types.uint4b8})()
    kernel.w_q_name, kernel.w_s_name = "qweight", "scales"
    layer = torch.nn.Module()
    layer.qweight = torch.nn.Parameter(torch.from_numpy(pack_bits(q, 4, axis=0)), requires_grad=False)
    layer.scales = torch.nn.Parameter(torch.ones(1, n, dtype=torch.bfloat16), requires_grad=False)
    kernel._process_gptq_weights_w4a16(layer)
    held = layer.qweight.data.numpy()
    np.testing.assert_array_equal(held, vllm_cpu.repack(q))
    np.testing.assert_array_equal(vllm_cpu.unrepack(held, k), q)
