"""The vLLM benchmarks in their tiny modes, in vLLM's venv (scripts/run-tests.sh): one engine
start each, eager. vllm_interleaved.py: one pair of generate calls (1 prompt x 2 tokens) under
`qforensics record`; served_incident.py: the OpenAI-compatible server under record for half a
minute of traffic, poisoned requests from 12 s on, kill -9, then analyze. About 1.5 to 2.5 min
each on 2 cores. vllm_overhead.py (three engine starts at the least) and healthy_stats.py --vllm
are not run here: see tests/engines for the engine paths they drive."""

from __future__ import annotations

import pytest
from bench_runs import NUM, figures, ratio_slack, run_bench

from qforensics.analyze import analyze_trace
from qforensics.trace.reader import open_trace

pytestmark = pytest.mark.vllm


def test_vllm_interleaved_one_pair(tmp_path):
    out = run_bench("vllm_interleaved.py", "--pairs", "1", "--prompts", "1", "--tokens", "2",
                    cwd=tmp_path, timeout=900)
    assert "1 pairs of calls" in out
    (p_med, p_fast) = figures(rf"plain\s+median {NUM} s, fastest {NUM} s", out)
    (c_med, c_fast) = figures(rf"captured\s+median {NUM} s, fastest {NUM} s", out)
    assert p_med == p_fast > 0 and c_med == c_fast > 0  # one call each
    (ratio,) = figures(rf"ratio captured / plain: median of pairs {NUM}", out)
    assert ratio == pytest.approx(c_med / p_med, abs=ratio_slack(c_med, p_med))  # one pair
    assert "calls whose tokens equal the plain call's of the same pair: 1 of 1" in out


def test_served_incident_short(tmp_path):
    work = tmp_path / "incident"
    out = run_bench("served_incident.py", "--minutes", "0.5", "--trigger-minute", "0.2",
                    "--eager", "--keep", str(work), cwd=tmp_path, timeout=900)
    assert "; eager; budget 128 MiB" in out
    (sent, answered, _tokens, poisoned) = figures(
        rf"requests: {NUM} sent, {NUM} answered, {NUM} tokens generated; {NUM} poisoned", out)
    assert answered >= 1 and poisoned >= 1 and sent >= answered
    (mib, budget) = figures(rf"trace after the stop: {NUM} MiB of a {NUM} MiB budget \(within",
                            out)
    assert budget == 128 and 0 < mib <= budget
    trace = work / "s-0.h5"
    with open_trace(trace) as tr:  # what kill -9 left behind reads
        assert tr.n_steps > 0
    assert "analyze exit 1" in out  # exit 1: a FAILED or SUSPECT finding
    (row,) = figures(rf"embedding row {NUM} NaN", out)
    f = analyze_trace(trace)
    assert f.verdict.status == "FAILED"  # the poisoned requests hit the NaN embedding row
    assert "model.embed_tokens.weight" in f.cause.line and f"row {int(row)}" in f.cause.line
