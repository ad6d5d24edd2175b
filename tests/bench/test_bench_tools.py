"""The benchmarks of triage, reports, the hooks' host cost and the guard's fallbacks, in their
tiny modes (no real model; seconds each, triage_fleet.py about half a minute). Expectations come
from what each script builds, not from a previous run."""

from __future__ import annotations

import json
import sys

import pytest
from bench_runs import BENCH, NUM, REPO, figures, ratio_slack, run_bench

SAMPLES = sorted((REPO / "sample_traces").glob("*.h5"))


def test_triage_fleet_tiny_writes_a_few_dozen_traces_and_finds_the_incidents(tmp_path):
    fleet = tmp_path / "fleet"
    out = run_bench("triage_fleet.py", "--tiny", "--dir", str(fleet), "--skip", "processes",
                    cwd=tmp_path, timeout=300)
    # --tiny: 30 traces, of which one copy of each committed sample, the rest synthetic (2 of
    # each of the 6 incident kinds, TP runs as 2 ranks); plus 4 unreadable files
    synthetic = sorted((fleet / "synthetic").rglob("*.h5"))
    real = sorted((fleet / "real").glob("*.h5"))
    assert len(real) == len(SAMPLES) and len(synthetic) == 30 - len(SAMPLES)
    assert len(list((fleet / "corrupt").glob("*.h5"))) == 4
    assert f"fleet: {30 + 4} trace files" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("local cluster"))
    (n, wall, rate) = figures(rf"{NUM} traces in {NUM} s = {NUM} traces/s", line)
    assert n == 34 and wall > 0 and rate == pytest.approx(n / wall, rel=0.05, abs=0.06)
    assert "groups as built: yes" in line and "4 unreadable" in line
    doc = json.loads((tmp_path / "fleet-out" / "local" / "stdout.json").read_text())
    real_groups = [g for g in doc["groups"] if all("/real/" in p for p in g["traces"])]
    synth_groups = [g for g in doc["groups"] if all("/synthetic/" in p for p in g["traces"])]
    assert len(synth_groups) == 6 and len(real_groups) == 6  # 2 FAILED + 4 SUSPECT samples
    assert len(doc["unreadable"]) == 4


def test_report_speed_times_one_sample(tmp_path):
    trace = REPO / "sample_traces" / "fp8-e4m3-nosat-act.h5"
    out = run_bench("report_speed.py", str(trace), cwd=tmp_path, timeout=120)
    (imp,) = figures(rf"import qforensics.reports: {NUM} s", out)
    (inproc, cli, cpu, kib) = figures(
        rf"{trace.name}\s+write_report\s+{NUM} s\s+cli\s+{NUM} s \(cpu {NUM} s\)\s+{NUM} KiB"
        r"\s+FAILED\s+ok", out)  # the sample whose FP8 activations overflow: FAILED
    assert min(imp, inproc, cli, cpu) > 0 and kib > 10
    (slowest,) = figures(rf"slowest cli run: {NUM} s", out)
    assert slowest == cli


def test_guard_fallbacks_sizes_each_layout(tmp_path):
    out = run_bench("guard_fallbacks.py", "--repeats", "1", "--tokens", "4", cwd=tmp_path,
                    timeout=180)
    k, n = 1536, 576  # the script's SmolLM2 down_proj
    dense = k * n * 4 / 2**20  # the dequantized weight, float32 activations
    int4 = k * n / 2 / 2**20  # 4-bit values, before scales and zeros
    for layout, lo, hi in (("AWQ GEMM", int4, 1.1 * int4), ("GPTQ", int4, 1.1 * int4),
                           ("compressed-tensors pack-quantized", int4, 1.1 * int4),
                           ("FP8", 2 * int4, 2.1 * int4)):
        (deq, packed, dense_mib, call) = figures(
            rf"(?m)^{layout}\s+{NUM} ms\s+{NUM} MiB\s+{NUM} MiB\s+{NUM} ms", out)
        assert deq > 0 and call > 0, layout
        assert lo <= packed <= hi, (layout, packed)
        assert dense_mib == round(dense, 2), layout


def test_param_health_cost_ratio_is_its_two_times(tmp_path):
    out = run_bench("param_health_cost.py", cwd=tmp_path, timeout=120)
    (counts, full, ratio) = figures(
        rf"counts only {NUM} ms, with levels and dominance {NUM} ms, ratio {NUM}", out)
    assert counts > 0 and full > 0 and abs(ratio - full / counts) < 0.01 + 0.01 * ratio
    if "param watch on SmolLM2" in out and "skipped" not in out:  # the real model installed
        check, idle, every, amort, step, pct = figures(
            rf"a check {NUM} ms, a step end without one {NUM} us; every {NUM} steps: {NUM} ms "
            rf"a step against a plain one-token step of {NUM} ms \({NUM}%\)", out)
        assert every == 256 and check > 0 and step > 0  # the default interval
        # the check spread over its interval, plus the step ends without one (printed rounded)
        assert abs(amort - (check / every + idle / 1e3)) <= 0.05 / every + 0.0006
        assert abs(pct - 100 * amort / step) <= 0.006 + 100 * 0.0006 / step


def test_collect_cost_times_both_paths_on_a_smollm2_sized_ring(tmp_path):
    out = run_bench("collect_cost.py", "--calls", "5", "--rounds", "1", cwd=tmp_path,
                    timeout=120)
    # SmolLM2's 30 layers of 16 entries; each entry keeps one row of its width in channels
    layer = (576,) * 7 + (1536,) * 3 + (576,) * 4 + (1536, 576)
    (entries, channels) = figures(rf"collect, {NUM} entries, {NUM} channels a step", out)
    assert entries == 30 * 16 and channels == 30 * sum(layer)
    (c_ms,) = figures(rf"qf_spans +{NUM} ms", out)
    (py_ms,) = figures(rf"slices +{NUM} ms", out)
    (ratio,) = figures(rf"slices / qf_spans: {NUM}", out)
    assert c_ms > 0 and py_ms > 0
    assert abs(ratio - py_ms / c_ms) <= ratio_slack(py_ms, c_ms) + 0.005  # ratio: 2 decimals


def test_compiled_guards_times_the_guards_of_both_phases(tmp_path):
    out = run_bench("compiled_guards.py", "--random", "--layers", "2", "--rounds", "1",
                    "--calls", "3", cwd=tmp_path, timeout=300)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    plain, captured, summary = rows
    assert (plain["phase"], captured["phase"]) == ("plain", "captured")
    # hooks add guards: each hooked module's hook dict and hook code, at least
    assert captured["leaf_guards"] > plain["leaf_guards"] > 0
    assert plain["check_us"] > 0 and captured["check_us"] > 0
    assert summary["check_us"] == [plain["check_us"], captured["check_us"]]
    assert summary["leaf_guards"] == [plain["leaf_guards"], captured["leaf_guards"]]
    added = captured["guard_ms"] - plain["guard_ms"]
    assert abs(summary["guard_ms_added"] - added) <= 0.0011  # 3 decimals each


def test_compiled_capture_compares_both_phases_and_their_compile_phases(tmp_path):
    out = run_bench("compiled_capture.py", "--random", "--layers", "2", "--tokens", "4",
                    cwd=tmp_path, timeout=600)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    plain, captured, cmp = rows
    assert (plain["phase"], captured["phase"]) == ("plain", "captured")
    assert cmp["tokens_identical"] and cmp["every_module_every_step"]
    # issue 39's bound: at most one generated kernel more per hooked module (the op itself is
    # opaque; a fusion it splits may add one)
    assert 0 <= cmp["kernels_added"] <= captured["graph_calls"]
    assert cmp["compile_ratio"] == round(captured["first_step_s"] / plain["first_step_s"], 3)
    phases = cmp["compile_phase_ratios"]
    assert "bytecode_tracing" in phases and set(phases) <= set(plain["compile_phases"])
    for k, r in phases.items():
        assert r == round(captured["compile_phases"][k] / plain["compile_phases"][k], 2), k
    # the host time per step, and within it the logits' op call (so never more than it)
    assert 0 < captured["host_op_ms_per_step"] <= captured["host_ms_per_step"]
    assert cmp["host_op_ms_per_step"] == captured["host_op_ms_per_step"]


def test_compiled_capture_with_a_kv_cache_decodes_one_token_a_step(tmp_path):
    """`--kv-cache`: the prompt in one step, then one token a step through a static cache;
    its greedy tokens are those of the same random model run eagerly with the whole sequence
    re-fed (computed here), and the captured run recorded every module at every step."""
    import argparse

    import torch

    sys.path.insert(0, str(BENCH))
    import compiled_capture

    out = run_bench("compiled_capture.py", "--random", "--layers", "2", "--tokens", "4",
                    "--kv-cache", cwd=tmp_path, timeout=900)
    plain, captured, cmp = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    assert plain["kv_cache"] and captured["kv_cache"] and cmp["kv_cache"]
    assert cmp["tokens_identical"] and cmp["every_module_every_step"]
    assert captured["steps"] == 4 and len(captured["steps_ms"]) == 2  # 2 compiling steps
    model, ids, _ = compiled_capture.build(argparse.Namespace(
        random=True, layers=2, dtype="float32", device="cpu"))
    x, want = torch.tensor([ids]), []
    with torch.no_grad():
        for _ in range(4):
            want.append(int(model(x).logits[0, -1].argmax()))
            x = torch.cat([x, torch.tensor([[want[-1]]])], 1)
    assert cmp["tokens"] == want


def test_capture_overhead_runs_the_random_architecture_without_the_model(tmp_path):
    """What scripts/gpu_session.sh runs on a GPU machine without the GGUF: every variant on
    SmolLM2's architecture with random weights."""
    out = run_bench("capture_overhead.py", "--random", "--layers", "2", "--tokens", "2",
                    "--rounds", "1", "--no-nnsight", cwd=tmp_path, timeout=300)
    assert "SmolLM2's architecture, random weights, 2 layers, cpu float32, 2 greedy tokens" in out
    (wall, ratio) = figures(rf"(?m)^plain\s+{NUM}\s+{NUM}", out)
    assert wall > 0 and ratio == 1.0
    for name in ("bare", "qf-default", "qf-scalar"):
        (w, r) = figures(rf"(?m)^{name}\s+{NUM}\s+{NUM}", out)
        assert w > 0 and r == pytest.approx(w / wall, abs=ratio_slack(w, wall)), name


def test_gpu_step_host_times_the_gpu_paths_step_end_on_its_stand_ins(tmp_path):
    """bench/gpu_step_host.py on the CPU: the GPU's path (host copies, a drainer) recorded
    every step, and the host time per step is its begin plus its end, each at least the
    parts timed inside it."""
    out = run_bench("gpu_step_host.py", "--layers", "1", "--steps", "40", cwd=tmp_path,
                    timeout=300)
    d = json.loads(out.strip().splitlines()[-1])
    assert d["capture_mode"] == "compiled" and d["steps_recorded"] == 40
    assert d["graph_drain"]["thread"] is True and d["graph_drain"]["dropped"] == 0
    us = d["us_per_step"]
    pre, post, end = (us[k] for k in ("CallHooks._on_root_pre", "CallHooks._on_root_post",
                                      "GraphLate._graph_end"))
    assert d["host_us_per_step"] == pytest.approx(pre + post, abs=0.2) and pre > 0
    assert d["torch_threads"] == 1  # the CPU default: no OpenMP thread beside the drainer
    # the whole step's own statistics: a percentile above the median, a positive mean
    assert d["host_us_p99"] >= d["host_us_median"] > 0 and d["host_us_mean"] > 0
    assert post >= end > 0  # medians: the end runs inside the root's post hook
    assert all(us[k] > 0 for k in ("GraphStats.start_copy", "GraphStats.put_step_extras",
                                   "GraphMode._graph_flush", "Drainer.put"))
