"""Speed figures (qforensics.whatif.speed) without vLLM: the rates of a round, the ratios to
bf16 over interleaved rounds, the order of the rounds, and the tie-break they feed.

Expectations are worked out by hand from the definitions in the module docstring: prefill
tokens/s = batch x prompt_tokens / prefill seconds; decode tokens/s = batch x (new_tokens - 1)
/ (decode seconds - prefill seconds); the ratio is the median over rounds of scheme / bf16 in
the same round."""

from __future__ import annotations

import math

import pytest

from qforensics.whatif.speed import (
    SpeedPlan,
    interleave,
    round_rates,
    speed_figures,
    speed_lines,
    timing_prompts,
)

PLAN = SpeedPlan(batch=8, prompt_tokens=64, new_tokens=16, rounds=3)


def test_round_rates_follow_the_definitions() -> None:
    r = round_rates(0.5, 2.0, PLAN)
    assert r["prefill_tok_s"] == pytest.approx(8 * 64 / 0.5)  # 1024
    assert r["decode_tok_s"] == pytest.approx(8 * 15 / 1.5)  # 80
    bad = round_rates(0.5, 0.4, PLAN)  # a decode call shorter than the prefill: no figure
    assert math.isnan(bad["decode_tok_s"]) and bad["prefill_tok_s"] == pytest.approx(1024)


def test_ratio_is_the_median_of_same_round_ratios() -> None:
    # bf16 decode: 80, 40, 80 tokens/s (the machine was busy in round 2, for both engines);
    # the scheme: 120, 60, 100 -> per-round ratios 1.5, 1.5, 1.25 -> median 1.5. The ratio of
    # the medians would be 100 / 80 = 1.25: pairing in time is what the interleave is for.
    def rnd(pre: float, dec_only: float) -> dict:
        return round_rates(pre, pre + dec_only, PLAN)

    bf16 = [rnd(0.5, 120 / 80), rnd(1.0, 120 / 40), rnd(0.5, 120 / 80)]
    sch = [rnd(0.25, 120 / 120), rnd(0.5, 120 / 60), rnd(0.4, 120 / 100)]
    got = speed_figures(bf16, sch, PLAN)
    assert got["decode_ratios"] == pytest.approx([1.5, 1.5, 1.25])
    assert got["decode_vs_bf16"] == pytest.approx(1.5)
    assert got["bf16_decode_tok_s"] == pytest.approx(80) and \
        got["scheme_decode_tok_s"] == pytest.approx(100)
    assert got["scheme_decode_tok_s_fastest"] == pytest.approx(120)
    # prefill: bf16 1024, 512, 1024; scheme 2048, 1024, 1280 -> ratios 2, 2, 1.25 -> 2
    assert got["prefill_vs_bf16"] == pytest.approx(2.0)
    assert got["rounds"] == 3 and got["plan"]["batch"] == 8 and "median" in got["statistic"]


class FakeEngine:
    """Stands in for a ServedEngine: fixed seconds per call, and a shared log of calls."""

    def __init__(self, name: str, log: list, pre: float, dec: float) -> None:
        self.name, self.log, self.pre, self.dec = name, log, pre, dec

    def time_round(self, prompts, max_tokens, timeout):
        assert len(prompts) == PLAN.batch and all(len(p) == PLAN.prompt_tokens for p in prompts)
        self.log.append((self.name, max_tokens))
        return self.pre if max_tokens == 1 else self.dec


def test_interleave_alternates_engines_round_by_round() -> None:
    log: list = []
    bf16, sch = FakeEngine("bf16", log, 0.5, 2.0), FakeEngine("s", log, 0.25, 1.0)
    slept: list[float] = []
    import qforensics.whatif.speed as speed

    real_sleep = speed.time.sleep
    speed.time.sleep = lambda s: (slept.append(s), log.append(("quiet", s)))
    try:
        got = interleave(bf16, sch, timing_prompts(list(range(1000)), PLAN), PLAN)
    finally:
        speed.time.sleep = real_sleep
    # every round starts after the settle time (the other engine quiet), never inside one
    assert slept == [speed.SETTLE_S] * 6
    assert all(log[i - 1][0] == "quiet" for i, (n, t) in enumerate(log) if n != "quiet" and t == 1)
    log[:] = [x for x in log if x[0] != "quiet"]
    # the scheme's warm-up, then bf16/scheme, scheme/bf16, bf16/scheme; each round one
    # prefill call (1 token) and one decode call (16 tokens)
    assert log[0] == ("s", 2)
    order = [n for n, t in log[1:] if t == 1]
    assert order == ["bf16", "s", "s", "bf16", "bf16", "s"]
    assert [t for _, t in log[1:]] == [1, 16] * 6
    # decode: 120 / 1.5 = 80 vs 120 / 0.75 = 160; prefill 1024 vs 2048
    assert got["decode_vs_bf16"] == pytest.approx(2.0)
    assert got["prefill_vs_bf16"] == pytest.approx(2.0)


def test_timing_prompts_are_distinct_windows_of_the_text() -> None:
    ps = timing_prompts(list(range(600)), PLAN)
    assert len(ps) == 8 and all(len(p) == 64 for p in ps)
    assert len({p[0] for p in ps}) == 8 and ps[0] == list(range(64))
    short = timing_prompts([1, 2, 3], SpeedPlan(batch=2, prompt_tokens=5))
    assert short == [[1, 2, 3, 1, 2], [2, 3, 1, 2, 3]]


def test_the_ratio_decides_a_memory_tie(tmp_path) -> None:
    from qforensics.whatif.recommend import Target, recommend
    from qforensics.whatif.results import SchemeResult, WhatIfResult

    res = WhatIfResult(trace=None, prompt_source="p", salient_source="s", ref_text="t",
                       ref_ppl=10.0, positions=8, text_tokens=100)
    for name, (pre, dec) in (("slow", (0.5, 2.0)), ("fast", (0.25, 1.0))):
        s = SchemeResult(name, "w", None, 1.0, 0.0, 10.0, 1.0, 0.995, False, "", 0.0)
        s.memory = {"vs_bf16": 0.4}
        got = speed_figures([round_rates(0.5, 2.0, PLAN)], [round_rates(pre, dec, PLAN)], PLAN)
        s.decode_speed_vs_bf16 = got["decode_vs_bf16"]  # slow: 1.0, fast: 2.0
        res.schemes.append(s)
    assert recommend(res, Target("recovered", 0.99))["scheme"] == "fast"


def test_the_table_says_how_speed_was_measured() -> None:
    class S:
        scheme = "ct:W8A8"
        vllm = {"speed": speed_figures([round_rates(0.5, 2.0, PLAN)] * 3,
                                       [round_rates(0.5, 2.0, PLAN)] * 3, PLAN)}

    class E:
        scheme = "ct:W4A16"
        vllm = {"speed": {"error": "speed not measured: vLLM did not finish"}}

    lines = speed_lines([S(), E()])
    assert "batch 8 x 64-token prompts, 16 greedy new tokens; median of 3 rounds" in lines[0]
    assert "does not carry to another" in lines[0]
    assert lines[1] == "  ct:W4A16: speed not measured: vLLM did not finish"
