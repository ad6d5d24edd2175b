"""The raw compute-sanitizer output measured on an H200 (tests/replay/fixtures/gpu_h200, written by
`python -m qforensics.replay.gpu_check`) through the parser and the verdicts."""

from __future__ import annotations

import json
from pathlib import Path

from qforensics.replay.parse import (
    attribute_buffers,
    parse_host_allocations,
    parse_sanitizer_output,
)
from qforensics.replay.verdict import Verdict, judge_sanitizer

FIX = Path(__file__).parent / "fixtures" / "gpu_h200"


def _judge(name: str, marker: str):
    report = parse_sanitizer_output((FIX / f"{name}.sanitizer-memcheck.txt").read_text())
    attribute_buffers(report, parse_host_allocations(report.host_lines))
    ran = any(marker in line for line in report.host_lines)
    return report, judge_sanitizer(report, kernel_ran=ran, print_limit=100)


def test_planted_out_of_bounds_read_is_a_kernel_fault_on_x():
    report, res = _judge("planted_oob_fixture", "qforensics-replay: kernel-done")
    assert res.verdict is Verdict.KERNEL_FAULT
    first = report.records[0]
    # x holds 3 rows x 1536 float16 = 9,216 bytes; the 8-row tile's 16-byte loads run past it
    assert first.buffer == "x" and first.kind == "read" and first.size == 16
    assert first.relation == "after" and first.distance == 1 and first.alloc_size == 3 * 1536 * 2
    assert first.kernel == "qf_awq_gemm_unchecked"


def test_reference_kernel_and_torch_ops_ran_clean_under_memcheck():
    for name, marker in (("reference_kernel", "qforensics-replay: kernel-done"),
                         ("torch_scaled_mm", "qforensics-launcher: done"),
                         ("torch_int4pack_mm", "qforensics-launcher: done")):
        report, res = _judge(name, marker)
        assert report.error_summary == 0, name
        assert res.verdict is Verdict.NOT_REPRODUCED, (name, res.line())


def test_summary_matches_the_raw_outputs():
    summary = json.loads((FIX / "summary.json").read_text())
    assert "H200" in summary["tools"]["nvidia_smi"] and summary["arch"] == "sm_90"
    cases = summary["cases"]
    assert cases["planted_oob_fixture"]["results"][0]["verdict"] == "KERNEL FAULT"
    assert cases["reference_kernel"]["results"][0]["details"]["max_abs_err_vs_reference"] < 1e-3
    # measured: Hopper's FP8 _scaled_mm is further from the float64 reference than fp32 accumulation allows
    scaled = cases["torch_scaled_mm"]["results"][0]
    assert scaled["verdict"] == "KERNEL DIVERGES" and scaled["details"]["kernel_nonfinite"] == 0
    assert cases["torch_int4pack_mm"]["results"][0]["verdict"] == "NOT REPRODUCED"


FIX_1204 = Path(__file__).parent / "fixtures" / "gpu-h200-2026-12-04"


def test_2026_12_04_run_raw_outputs_and_the_shared_bundle_bug_it_recorded():
    summary = json.loads((FIX_1204 / "summary.json").read_text())
    assert "H200" in summary["tools"]["nvidia_smi"] and summary["tools"]["torch"] == "2.11.0+cu130"
    for name, marker in (("reference_kernel", "qforensics-replay: kernel-done"),
                         ("torch_scaled_mm", "qforensics-launcher: done"),
                         ("torch_int4pack_mm", "qforensics-launcher: done")):
        report = parse_sanitizer_output((FIX_1204 / f"{name}.sanitizer-memcheck.txt").read_text())
        ran = any(marker in line for line in report.host_lines)
        assert judge_sanitizer(report, kernel_ran=ran, print_limit=100).verdict is Verdict.NOT_REPRODUCED, name
    report = parse_sanitizer_output((FIX_1204 / "planted_oob_fixture.sanitizer-memcheck.txt").read_text())
    attribute_buffers(report, parse_host_allocations(report.host_lines))
    res = judge_sanitizer(report, kernel_ran=False, print_limit=100)
    assert res.verdict is Verdict.KERNEL_FAULT and report.records[0].buffer == "x" and report.records[0].line == 94
    # the torch.compile case's memcheck opened the int4pack case's bundle, from a folder already removed
    raw = (FIX_1204 / "torch_compile_triton.sanitizer-memcheck.txt").read_text()
    assert "qf-gpu-torch_int4pack_mm-" in raw and "no such file" in raw
    res = judge_sanitizer(parse_sanitizer_output(raw), kernel_ran=False, print_limit=100)
    assert res.verdict is Verdict.INCONCLUSIVE
    argv = summary["cases"]["torch_compile_triton"]["results"][1]["details"]["sanitizer"]["argv"]
    assert "torch_int4pack_mm" in argv[argv.index("--bundle") + 1]
