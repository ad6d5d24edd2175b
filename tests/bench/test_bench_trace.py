"""The trace benchmarks in their tiny modes: analyze_speed.py, trace_budget.py, writer_cost.py
(no model, no torch; a few seconds each). Expectations come from how each script builds its
trace, as its docstring says, not from a previous run."""

from __future__ import annotations

import math

from bench_runs import NUM, figures, run_bench

from qforensics.trace.reader import open_trace


def test_analyze_speed_writes_its_trace_and_times_analyze(tmp_path):
    path = tmp_path / "bench.h5"
    size_gb = 0.02
    out = run_bench("analyze_speed.py", "--size-gb", str(size_gb), "--path", str(path),
                    "--repeat", "1", cwd=tmp_path, timeout=120)
    # 12 layers x (4 linears + the block), input and output: 120 records a step, each with
    # min and max over 4,096 float32 channels; gzip keeps about 80% of random floats
    per_step = 12 * 5 * 2 * 4096 * 4 * 2
    steps = max(2, int(size_gb * 1e9 / (per_step * 0.8)))
    bad_from = int(steps * 0.8)
    assert f"{steps} steps" in out and f"NaN from step {bad_from}" in out
    lines = out.splitlines()
    verdict = next(ln for ln in lines if ln.startswith(("FAILED", "SUSPECT", "PASSED")))
    assert verdict.startswith(f"FAILED | first non-finite at step {bad_from}")
    assert "model.layers.7.mlp.down_proj" in verdict  # the module the script plants the NaN in
    (best, run) = figures(rf"best {NUM} s, runs {NUM} s", out)
    assert 0 < best == run  # one run: the best is that run
    with open_trace(path) as tr:
        assert tr.n_steps == steps


def test_trace_budget_keeps_the_budget_and_the_planted_failure(tmp_path):
    seconds, rate, mib, fail_at = 60, 20, 24, 20
    out = run_bench("trace_budget.py", "--seconds", str(seconds), "--rate", str(rate),
                    "--max-mib", str(mib), "--fail-at", str(fail_at), "--channels", "25344",
                    "--ring-chunk", "4096", cwd=tmp_path, timeout=120)
    assert out.startswith(f"{seconds * rate} steps")
    (per_step,) = figures(rf"full detail is appended: {NUM} KiB", out)
    assert per_step > 0
    (capped,) = figures(rf"full detail stopped at step {NUM} ", out)
    assert fail_at < capped < seconds * rate  # the budget was reached, after the failure
    (end, budget) = figures(rf"file size at the end: {NUM} MiB of {NUM} MiB \(within", out)
    assert budget == mib and end <= mib
    # the script plants the NaN in the output of module 40 (its modules: model.layers.{i}.proj)
    assert (f"planted failure at step {fail_at} found: True (producer model.layers.40.proj)"
            in out)


def test_writer_cost_prints_the_schedule_and_the_write_costs(tmp_path):
    step_ms, channels = 45, 2000
    out = run_bench("writer_cost.py", "--records", "20", "--channels", str(channels), "--rows",
                    "2", "--step-ms", str(step_ms), "--steps", "8", cwd=tmp_path, timeout=120)
    # the earlier rule: a write at the first step end past half the flush interval (0.5 s)
    per_write = math.ceil(0.5 / (step_ms / 1e3))
    before_wps = 1 / (per_write * step_ms / 1e3)
    (b, n_b, now, n_now) = figures(
        rf"writes/s\s+before {NUM} \({NUM} steps a write\), now {NUM} \({NUM} steps", out)
    assert (b, n_b) == (round(before_wps, 2), per_write)
    assert 0 < now <= 1 / (step_ms / 1e3) and n_now >= 1
    (w4, w1, r4, r1) = figures(rf"ms/write\s+before {NUM} \(gzip 4\), now {NUM} \(gzip 1\); "
                               rf"ring {NUM} / {NUM} ms", out)
    assert min(w4, w1, r4, r1) > 0
    ring_mb = 2 * 16 * channels * 4 / 1e6  # min and max, 16 slots, float32
    assert f"the ring's fixed {ring_mb:.1f} MB included" in out
    (before, after, ratio) = figures(rf"writer ms/s\s+before {NUM}, now {NUM}: ratio "
                                     rf"now/before {NUM}", out)
    assert abs(ratio - after / before) < 0.02  # the printed figures are rounded
