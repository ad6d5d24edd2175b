"""The benchmarks that run the real SmolLM2-135M through transformers, in their tiny modes (2 to
8 tokens, one round; about 15-20 s each, the first of a session also converts the model, ~40 s).
Expectations come from the arguments and what each script says it measures."""

from __future__ import annotations

import pytest
from bench_runs import NUM, figures, ratio_slack, run_bench

from qforensics.trace.reader import open_trace

pytestmark = pytest.mark.model


def test_capture_overhead_prints_each_variant_against_plain(tmp_path):
    out = run_bench("capture_overhead.py", "--tokens", "2", "--rounds", "1", "--no-nnsight",
                    cwd=tmp_path, timeout=300)
    assert "SmolLM2-135M, 2 greedy tokens" in out
    (wall, ratio) = figures(rf"(?m)^plain\s+{NUM}\s+{NUM}", out)
    assert wall > 0 and ratio == 1.0  # plain against itself
    for name in ("bare", "qf-default", "qf-scalar"):
        (w, r, cpu, cpu_ratio) = figures(rf"(?m)^{name}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}", out)
        # walls printed to 1 ms, the ratio (of the unrounded walls) to 0.001
        assert w > 0 and cpu > 0, name
        assert r == pytest.approx(w / wall, abs=ratio_slack(w, wall)), name
    (kib_default,) = figures(rf"(?m)^qf-default(?:\s+{NUM}){{4}}\s+{NUM}", out)[-1:]
    (kib_scalar,) = figures(rf"(?m)^qf-scalar(?:\s+{NUM}){{4}}\s+{NUM}", out)[-1:]
    assert kib_default > kib_scalar > 0  # scalars only keep less than per-channel ranges too


def test_guard_overhead_repairs_the_fp8_scenario(tmp_path):
    out = run_bench("guard_overhead.py", "--repeats", "1", "--max-new-tokens", "2",
                    cwd=tmp_path, timeout=300)
    for name in ("unguarded", "guard check=logits", "guard check=modules"):
        (t, r, tf, rf_) = figures(rf"{name}\s+generate 2 tokens:\s+{NUM}s\s+ratio {NUM}\s+\|"
                                  rf"\s+one \d+-token forward:\s+{NUM}s\s+ratio {NUM}", out)
        assert t > 0 and tf > 0 and r > 0 and rf_ > 0, name
    assert "without guard" in out and "NaN logits: True" in out  # the scenario fails unguarded
    assert "finite logits: True" in out
    assert "guarded greedy answer identical to the reference: True" in out


def test_hf_step_profile_times_capture_functions(tmp_path):
    tokens = 2
    out = run_bench("hf_step_profile.py", "--tokens", str(tokens), cwd=tmp_path, timeout=300)
    (plain, per, captured, ratio) = figures(
        rf"plain {NUM} s \({NUM} ms a step\), captured with timers {NUM} s, ratio {NUM}", out)
    assert ratio == pytest.approx(captured / plain, abs=ratio_slack(captured, plain))
    # plain is printed to 1 ms and per to 0.1 ms: allow both roundings
    assert per == pytest.approx(plain / tokens * 1e3, abs=0.5 / tokens + 0.05 + 1e-9)
    (steps,) = figures(rf"where a captured step's time went \({NUM} steps\)", out)
    assert steps == tokens  # generate: one forward a new token (the prefill makes the first)
    (ms, calls) = figures(rf"CallHooks._on_root_pre\s+{NUM} ms/step\s+{NUM} calls/step", out)
    assert ms > 0 and calls == 1.0  # one root forward a step


def test_trace_size_breaks_the_file_down(tmp_path):
    tokens = 4
    out = run_bench("trace_size.py", "--tokens", str(tokens), cwd=tmp_path, timeout=300)
    (steps,) = figures(rf"{tokens} greedy tokens, channel_steps=auto: {NUM} steps", out)
    assert steps == tokens
    (mib, kib_step, ring) = figures(rf"trace {NUM} MiB = {NUM} KiB per step; ring {NUM} MiB", out)
    # both printed to one decimal: the MiB's rounding, spread over the steps, plus the KiB's
    assert kib_step == pytest.approx(mib * 1024 / steps, abs=0.05 * 1024 / steps + 0.05 + 1e-9)
    assert 0 < ring < mib


def test_healthy_stats_measures_its_runs(tmp_path):
    keep = tmp_path / "traces"
    out = run_bench("healthy_stats.py", "--hf-tokens", "8", "--greedy", "1", "--sampled", "1",
                    "--out", str(keep), cwd=tmp_path, timeout=300)
    traces = sorted(keep.rglob("*.h5"))
    assert [p.name for p in traces] == ["hf-greedy-0.h5", "hf-sample-0.h5"]
    for p in traces:
        with open_trace(p) as tr:
            assert tr.n_steps == 8  # 8 new tokens: the prefill and 7 decode steps
        assert figures(rf"(?m)^{p.name}\s+{NUM}", out) == (8.0,)
        assert f"PASSED | no non-finite values in 8 steps" in out  # the unquantized model
    (growth, floor) = figures(rf"growth_factor\s+{NUM}\s+rule: >= logits_growth_factor = {NUM}",
                              out)
    assert growth < floor  # healthy runs stay below what a failure must reach
