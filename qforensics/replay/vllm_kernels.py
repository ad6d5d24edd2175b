"""vLLM's own CPU kernels as kernels under judgement (need an environment where vLLM imports).

- ``vllm-cpu-wna16``: ``vllm._custom_ops.cpu_gemm_wna16``, the kernel of vLLM's
  ``CPUWNA16LinearKernel`` (AWQ / GPTQ W4A16 on CPU), on the tensors the layer holds after
  loading (layout ``vllm-cpu-w4a16``).

Each answers ``can_run`` with the reason first; vLLM is imported only then.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qforensics.replay.layouts import Layout


def vllm_available() -> tuple[bool, str]:
    try:
        import vllm  # noqa: F401
        from vllm import _custom_ops  # noqa: F401
    except Exception as exc:  # any import failure means "not here"
        return False, f"vLLM does not import here ({type(exc).__name__}: {str(exc)[:120]}); run replay in vLLM's environment"
    return True, f"vllm {vllm.__version__}"


def _wna16_can(t: dict[str, np.ndarray], meta: dict[str, Any], layout: Layout, device: str) -> tuple[bool, str]:
    if layout.name != "vllm-cpu-w4a16":
        return False, f"vllm-cpu-wna16 takes the layout vLLM's CPU W4A16 kernel holds; this layout is {layout.name}"
    if device != "cpu":
        return False, "vllm-cpu-wna16 is a CPU kernel"
    ok, why = vllm_available()
    if not ok:
        return False, why
    from qforensics.engines.vllm_cpu import w4a16_runs

    ok, why = w4a16_runs()  # the Python wrapper exists in every build; the kernel may not
    return (True, "vllm._custom_ops.cpu_gemm_wna16") if ok else (False, why)


def _wna16_run(t: dict[str, np.ndarray], meta: dict[str, Any], layout: Layout, device: str) -> np.ndarray:
    import torch
    from vllm import _custom_ops as ops
    from vllm.model_executor.kernels.linear.mixed_precision.cpu import _get_isa_hint

    dt = getattr(torch, str(meta.get("compute_dtype") or "bfloat16"))
    scales = torch.from_numpy(np.array(t["scales"])).to(dt)
    zeros = torch.from_numpy(np.array(t["qzeros"])) if t.get("qzeros") is not None else None
    x = torch.from_numpy(np.array(t["x"])).to(dt)
    isa = _get_isa_hint(dt)
    if isa == "amx" and not torch.cpu._init_amx():  # the AMX tiles must be granted first, as vLLM's worker does
        raise RuntimeError("this CPU reports AMX but the kernel refused the AMX tile permission")
    y = ops.cpu_gemm_wna16(input=x, q_weight=torch.from_numpy(np.array(t["qweight"])), scales=scales, zeros=zeros,
                           bias=None, pack_factor=8, isa_hint=isa)
    return y.double().numpy()
