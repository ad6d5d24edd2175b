"""compute-sanitizer report formats (memcheck, racecheck, API errors, no GPU) parse with exact fields.

Real output measured on an H200 is parsed in test_replay_gpu_fixtures.py."""

from __future__ import annotations

from qforensics.replay.parse import (
    attribute_buffers,
    parse_host_allocations,
    parse_sanitizer_output,
)

DEMO = """========= COMPUTE-SANITIZER
========= Invalid __global__ write of size 4 bytes
=========     at out_of_bounds_function()+0xb0 in memcheck_demo.cu:39
=========     by thread (0,0,0) in block (0,0,0)
=========     Address 0x87654320 is out of bounds
=========     and is 137,179,965,340,896 bytes before the nearest allocation at 0x7cc43a800000 of size 1,024 bytes
=========         Device Frame: out_of_bounds_kernel()+0x30 in memcheck_demo.cu:44
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: run_out_of_bounds() [0xadb6] in memcheck_demo
=========
========= Program hit cudaErrorLaunchFailure (error 719) due to "unspecified launch failure" on CUDA API call to cudaDeviceSynchronize.
=========     Saved host backtrace up to driver entry point at error
=========
========= Target application returned an error
========= ERROR SUMMARY: 2 errors
"""

HECBENCH = """========= Invalid __global__ read of size 4 bytes
=========     at compress(const unsigned int *, const unsigned int *, uint2 *, int)+0xb0
=========     by thread (1,0,0) in block (5,0,0)
=========     Access at 0x7f698ba00144 is out of bounds
=========     and is 1 bytes after the nearest allocation at 0x7f698ba00000 of size 324 bytes
"""

PYTORCH = """========= Invalid __global__ write of size 256 bytes
=========     at bulk_copy_range(unsigned char *, int)+0x120
=========     by thread (0,0,0) in block (0,0,0)
=========     Access to 0x147267fff80 is out of bounds
=========     and is inside the nearest allocation at 0x14725400000 of size 20971520 bytes
"""

QUICKSILVER = """========= Invalid __global__ read of size 8
=========     at 0x000002e8 in CycleTrackingGuts(MonteCarlo*, int, ParticleVault*, ParticleVault*)
=========     by thread (127,0,0) in block (194,0,0)
=========     Address 0x7f153e0002e8 is out of bounds
"""

UNKNOWN_DIR = "========= Invalid __shared__ ? of size 2048 bytes\n"

NO_GPU = """========= Error: Target application terminated before first instrumented API call
========= Error: couldn't find exit code.
"""


def test_memcheck_demo_block():
    r = parse_sanitizer_output(DEMO)
    assert len(r.records) == 1
    rec = r.records[0]
    assert (rec.kind, rec.size, rec.space, rec.error) == ("write", 4, "__global__", "out_of_bounds")
    assert (rec.function, rec.pc, rec.source, rec.line) == ("out_of_bounds_function()", "0xb0", "memcheck_demo.cu", 39)
    assert rec.kernel == "out_of_bounds_kernel()"
    assert rec.thread == (0, 0, 0) and rec.block == (0, 0, 0)
    assert rec.address == 0x87654320
    assert (rec.relation, rec.distance) == ("before", 137_179_965_340_896)
    assert (rec.alloc_address, rec.alloc_size) == (0x7CC43A800000, 1024)
    assert rec.alloc_address - rec.address == rec.distance
    assert [(e.name, e.number, e.description, e.call) for e in r.api_errors] == [
        ("cudaErrorLaunchFailure", 719, "unspecified launch failure", "cudaDeviceSynchronize")]
    assert r.target_returned_error is True
    assert r.error_summary == 2
    assert r.terminated_before_instrumentation is False


def test_hecbench_block_access_at_after():
    rec, = parse_sanitizer_output(HECBENCH).records
    assert (rec.kind, rec.size, rec.space) == ("read", 4, "__global__")
    assert rec.function == "compress(const unsigned int *, const unsigned int *, uint2 *, int)"
    assert rec.pc == "0xb0" and rec.source is None and rec.line is None
    assert rec.thread == (1, 0, 0) and rec.block == (5, 0, 0)
    assert rec.address == 0x7F698BA00144 and rec.error == "out_of_bounds"
    assert (rec.relation, rec.distance, rec.alloc_address, rec.alloc_size) == ("after", 1, 0x7F698BA00000, 324)


def test_pytorch_block_access_to_inside():
    rec, = parse_sanitizer_output(PYTORCH).records
    assert (rec.kind, rec.size) == ("write", 256)
    assert rec.function == "bulk_copy_range(unsigned char *, int)" and rec.pc == "0x120"
    assert rec.address == 0x147267FFF80
    assert (rec.relation, rec.distance, rec.alloc_address, rec.alloc_size) == ("inside", 0, 0x14725400000, 20971520)


def test_quicksilver_old_wording():
    rec, = parse_sanitizer_output(QUICKSILVER).records
    assert (rec.kind, rec.size, rec.space) == ("read", 8, "__global__")
    assert rec.pc == "0x000002e8"
    assert rec.function == "CycleTrackingGuts(MonteCarlo*, int, ParticleVault*, ParticleVault*)"
    assert rec.thread == (127, 0, 0) and rec.block == (194, 0, 0)
    assert rec.address == 0x7F153E0002E8 and rec.error == "out_of_bounds"
    assert rec.relation is None and rec.alloc_address is None


def test_unknown_direction_shared():
    rec, = parse_sanitizer_output(UNKNOWN_DIR).records
    assert (rec.kind, rec.size, rec.space) == ("?", 2048, "__shared__")
    assert rec.thread is None and rec.address is None


def test_no_gpu_block():
    r = parse_sanitizer_output(NO_GPU)
    assert r.terminated_before_instrumentation is True
    assert r.records == [] and r.error_summary is None
    assert r.tool_errors == ["Error: Target application terminated before first instrumented API call",
                             "Error: couldn't find exit code."]


def test_misaligned_and_summary_with_separators():
    text = ("========= Invalid __global__ read of size 16 bytes\n"
            "=========     at qf_awq_gemm_unchecked+0x2d0 in awq_gemm.cu:94\n"
            "=========     by thread (4,0,0) in block (1,0,0)\n"
            "=========     Address 0x7f0000000006 is misaligned\n"
            "========= ERROR SUMMARY: 1,234 errors (1,134 errors not displayed)\n")
    r = parse_sanitizer_output(text)
    assert r.records[0].error == "misaligned" and r.records[0].size == 16
    assert (r.records[0].source, r.records[0].line) == ("awq_gemm.cu", 94)
    assert r.error_summary == 1234 and r.not_displayed == 1134


def test_host_lines_and_buffer_attribution():
    text = ("qforensics-replay: alloc x 0x7f698ba00000 324\n" + HECBENCH + "========= ERROR SUMMARY: 1 error\n")
    r = parse_sanitizer_output(text)
    allocs = parse_host_allocations(r.host_lines)
    assert allocs == {"x": (0x7F698BA00000, 324)}
    attribute_buffers(r, allocs)
    assert r.records[0].buffer == "x"
    assert r.records[0].describe() == ("kernel compress(const unsigned int *, const unsigned int *, uint2 *, int), "
                                       "block (5,0,0), thread (1,0,0), reads 4 bytes at 1 bytes past the end of `x`")
