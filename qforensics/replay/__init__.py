"""Kernel replay: snapshot -> replay bundle -> project kernel under compute-sanitizer, or CPU emulation.

Public API (see docs/replay.md):
    build_bundle, build_bundle_from_trace, read_bundle, write_bundle, Bundle
    build_kernel, write_kernel_inputs                    (nvcc build of kernels/awq_gemm.cu)
    find_sanitizer, sanitizer_command, run_sanitizer     (compute-sanitizer runner)
    parse_sanitizer_output, AccessRecord, SanitizerReport
    LaunchGeometry, emulate_launch                       (bounds-checked CPU emulation)
    replay, ReplayOutcome, Verdict, ReplayResult
"""

from __future__ import annotations

from qforensics.replay.build import build_bundle, build_bundle_from_trace
from qforensics.replay.bundle import Bundle, read_bundle, write_bundle
from qforensics.replay.emulate import EmulationResult, LaunchGeometry, emulate_launch
from qforensics.replay.kernel import build_kernel, write_kernel_inputs
from qforensics.replay.parse import parse_sanitizer_output
from qforensics.replay.records import AccessRecord, ApiError, SanitizerReport
from qforensics.replay.run import ReplayOutcome, detect_gpu, replay
from qforensics.replay.sanitizer import find_sanitizer, run_sanitizer, sanitizer_command
from qforensics.replay.verdict import ReplayResult, Verdict

__all__ = [
    "AccessRecord", "ApiError", "Bundle", "EmulationResult", "LaunchGeometry", "ReplayOutcome", "ReplayResult",
    "SanitizerReport", "Verdict", "build_bundle", "build_bundle_from_trace", "build_kernel", "detect_gpu",
    "emulate_launch", "find_sanitizer", "parse_sanitizer_output", "read_bundle", "replay", "run_sanitizer",
    "sanitizer_command", "write_bundle", "write_kernel_inputs",
]
