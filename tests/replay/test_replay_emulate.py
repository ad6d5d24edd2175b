"""CPU emulation of the project kernel's index arithmetic: the public bug shapes, and numerics."""

from __future__ import annotations

import dataclasses
import re
import tracemalloc

import numpy as np
from replay_helpers import make_awq

from qforensics.layouts import awq
from qforensics.replay.emulate import (
    KERNEL_SOURCE,
    SITES,
    LaunchGeometry,
    emulate_launch,
    site_lines,
    wrap32,
)
from qforensics.replay.records import AccessRecord


def tensors(m, n, k, g, groups=None, seed=0):
    s = make_awq(m, n, k, g, groups=groups, seed=seed)
    return {"x": s.pop("input.0"), **s}


def reference(t, g):
    return t["x"].astype(np.float64) @ awq.dequantize(t["qweight"], t["qzeros"], t["scales"], g, t.get("g_idx"))


def test_wrap32():
    np.testing.assert_array_equal(wrap32(np.array([2**31 - 1, 2**31, 2**32, 2**32 + 5, -1])),
                                  [2**31 - 1, -(2**31), 0, 5, -1])


def test_every_site_marker_is_in_the_kernel_source():
    lines = site_lines()
    assert set(lines) == set(SITES)
    src = KERNEL_SOURCE.read_text().splitlines()
    for site, line in lines.items():
        assert SITES[site][4] in src[line - 1]


def test_in_bounds_launch_is_clean_and_equals_reference():
    t = tensors(16, 128, 256, 64)
    res = emulate_launch(LaunchGeometry.from_tensors(t, 64), data=t, reference=reference(t, 64))
    assert res.total_errors == 0 and res.records == [] and res.clean
    assert res.blocks_evaluated == res.blocks_total == 4 and not res.sampled
    assert res.numerics["compared"] == 16 * 128 and res.numerics["mismatches"] == 0
    np.testing.assert_allclose(res.output, reference(t, 64), rtol=1e-12, atol=1e-12)


def test_fewer_rows_than_the_tile_reads_past_x():
    """mit-han-lab/llm-awq issue 170: fewer than 8 tokens."""
    m, n, k = 3, 128, 256
    t = tensors(m, n, k, 64)
    res = emulate_launch(LaunchGeometry.from_tensors(t, 64), data=t, reference=reference(t, 64))
    # threads 12..31 load rows 3..7: 20 threads x 8 k-tiles x 2 column blocks
    assert res.total_errors == 20 * 8 * 2
    assert set(res.by_buffer) == {"x"} and res.by_buffer["x"]["after"] == 320
    first = res.records[0]
    assert isinstance(first, AccessRecord)
    assert (first.kind, first.size, first.buffer, first.relation) == ("read", 16, "x", "after")
    assert first.block == (0, 0, 0) and first.thread == (12, 0, 0)
    # row 3, k 0: byte offset 3*256*2 = 1536 = alloc size; memcheck counts "after" from the last byte
    assert first.alloc_size == m * k * 2 and first.distance == 1
    assert first.address - first.alloc_address == 1536
    assert (first.source, first.line) == ("awq_gemm.cu", site_lines()["x"])
    assert "past the end of `x`" in first.describe()
    # stores are guarded: valid rows still equal the reference
    assert res.numerics["mismatches"] == 0 and res.numerics["compared"] == m * n


def test_k_not_multiple_of_group_size_reads_scales_and_qzeros_past_end():
    t = tensors(8, 64, 96, 64, groups=1)  # K/G floored to 1 row of scales; k 64..95 use group 1
    res = emulate_launch(LaunchGeometry.from_tensors(t, 64), data=t)
    assert set(res.by_buffer) == {"qzeros", "scales"}
    assert res.by_buffer["qzeros"]["count"] == 32 * 8  # 32 k rows x 8 words
    assert res.by_buffer["scales"]["count"] == 32 * 8 * 4  # 4 half2 loads each
    first = res.records[0]
    assert first.buffer == "qzeros" and first.relation == "after" and first.distance == 1
    assert first.block == (0, 0, 0) and first.thread == (0, 0, 0)
    assert res.numerics["unknown"] == 8 * 64


def test_g_idx_out_of_range_reads_scales_past_end():
    """ModelCloud/GPTQModel issue 2949, vllm PR 48470."""
    t = tensors(8, 64, 128, 64)
    g = (np.arange(128) // 64).astype(np.int32)
    g[70] = 5
    t["g_idx"] = g
    geom = LaunchGeometry.from_tensors(t, 64)
    res = emulate_launch(geom)
    assert set(res.by_buffer) == {"qzeros", "scales"}
    assert res.by_buffer["qzeros"]["count"] == 8 and res.by_buffer["scales"]["count"] == 32
    rec = res.records[0]
    assert rec.buffer == "qzeros" and rec.thread == (6 * 8, 0, 0)  # k = 70 = k-tile 2, row 6
    assert rec.distance == (5 * 8 * 4) - (2 * 8 * 4 - 1)
    checked = emulate_launch(geom, checked=True)
    assert checked.total_errors == 0 and checked.checked_flags == 1 and not checked.clean


def test_negative_g_idx_reads_before():
    t = tensors(8, 64, 64, 32)
    t["g_idx"] = np.full(64, -1, np.int32)
    res = emulate_launch(LaunchGeometry.from_tensors(t, 32))
    assert res.by_buffer["scales"]["before"] == res.by_buffer["scales"]["count"] > 0
    assert res.records[0].relation == "before"


def test_int32_overflow_at_m_times_n_above_2_31_without_allocating():
    """unslothai/unsloth issue 6830: offsets wrap when M*N > 2^31."""
    m, n, k = 2**20 + 8, 4096, 64
    geom = LaunchGeometry(M=m, N=n, K=k, group_size=64, n_groups=1,
                          sizes={"x": m * k * 2, "qweight": k * n // 2, "qzeros": n // 2, "scales": n * 2, "y": m * n * 4})
    tracemalloc.start()
    res = emulate_launch(geom)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 512 * 2**20
    assert res.sampled and res.blocks_evaluated < 100 and res.blocks_total == 64 * (m // 8)
    assert res.analytic["y_int32_overflow_outputs"] == m * n - 2**31
    assert res.analytic["y_first_overflow"] == {"m": 2**31 // n, "n": 0}
    y = res.by_buffer["y"]
    assert y["int32_overflow"] == y["count"] > 0 and y["before"] > 0
    first_y = next(r for r in res.records if r.buffer == "y")
    assert first_y.overflow and first_y.kind == "write" and first_y.relation == "before"
    assert first_y.block[1] == (2**31 // n) // 8
    # rows past 2^32 / N wrap back inside the allocation: silent corruption, still reported
    assert y["int32_overflow"] > y["before"] + y["after"]
    assert "x" not in res.by_buffer  # M*K < 2^31


def test_k_not_multiple_of_8_is_misaligned():
    t = tensors(8, 64, 36, 4)
    res = emulate_launch(LaunchGeometry.from_tensors(t, 4))
    assert res.by_buffer["x"]["misaligned"] > 0
    mis = [r for r in res.records if r.error == "misaligned"]
    assert mis and mis[0].size == 16 and "misaligned" in mis[0].describe()


def test_k_tail_reads_next_row_in_bounds_and_qweight_past_end():
    t = tensors(16, 64, 48, 16)  # K % 32 == 16: last k-tile runs over
    res = emulate_launch(LaunchGeometry.from_tensors(t, 16), data=t, reference=reference(t, 16))
    assert "qweight" in res.by_buffer and res.by_buffer["qweight"]["after"] > 0


def test_checked_build_preconditions():
    t = tensors(8, 64, 64, 32)
    t["qweight"] = t["qweight"][:32]  # qweight rows != K: vLLM's host checks miss this
    geom = LaunchGeometry.from_tensors(t, 32)
    checked = emulate_launch(geom, checked=True)
    assert any(p.startswith("qweight") for p in checked.preconditions)
    unchecked = emulate_launch(geom)
    assert unchecked.by_buffer["qweight"]["after"] == 32 * 8


def test_record_fields_match_parser_records():
    names = {f.name for f in dataclasses.fields(AccessRecord)}
    t = tensors(3, 64, 64, 32)
    rec = emulate_launch(LaunchGeometry.from_tensors(t, 32)).records[0]
    assert set(rec.to_dict()) == names
    assert rec.origin == "emulation" and re.match(r"0x[0-9a-f]+", rec.to_dict()["address"])


def test_emulation_is_vectorised_fast_enough():
    import time
    t = tensors(1, 4096, 4096, 128)
    t0 = time.perf_counter()
    res = emulate_launch(LaunchGeometry.from_tensors(t, 128), data=t)
    assert time.perf_counter() - t0 < 20
    assert res.by_buffer["x"]["count"] == 28 * 128 * 64
