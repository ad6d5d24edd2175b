"""Speed through vLLM: decode and prefill tokens/s of a served scheme against bfloat16.

Measured in the run that scores them, with both engines up at once (the bfloat16 engine stays
up for the whole run; each scheme's engine is started beside it), in timed rounds that
alternate between the two: round r times bf16 then the scheme (odd rounds: the scheme first),
so that whatever else the machine is doing falls on both. Each engine first serves one untimed
warm-up. One round on one engine is two ``generate`` calls on the same `SpeedPlan.batch`
prompts of `SpeedPlan.prompt_tokens` tokens (windows of the fixed text; prefix caching off):

- prefill: 1 new token each; prefill tokens/s = batch x prompt_tokens / its seconds;
- decode: `SpeedPlan.new_tokens` new tokens each (greedy, ``ignore_eos``); decode tokens/s =
  batch x (new_tokens - 1) / (its seconds - the prefill call's seconds).

A ratio is the scheme's figure over bf16's in the same round; the result is the median of the
rounds' ratios (the fastest round of each engine is kept too). The figures are vLLM's as
whatif serves it (eager mode, bfloat16 activations, this machine's cores): a ratio from one CPU
does not carry to another.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from qforensics.errors import QForensicsError

__all__ = ["SpeedPlan", "SpeedTimer", "interleave", "round_rates", "speed_figures", "speed_lines",
           "timing_prompts"]


@dataclass(frozen=True)
class SpeedPlan:
    batch: int = 8  # prompts served together
    prompt_tokens: int = 64  # tokens per prompt (prefilled)
    new_tokens: int = 16  # tokens generated per prompt in the decode call
    rounds: int = 3  # timed rounds per engine, interleaved
    round_timeout: float = 120.0  # seconds one call may take before the scheme is not timed


def timing_prompts(text_ids: list[int], plan: SpeedPlan) -> list[list[int]]:
    """``plan.batch`` distinct windows of ``plan.prompt_tokens`` tokens of the fixed text
    (wrapping around a text shorter than batch x prompt_tokens)."""
    n, p = len(text_ids), plan.prompt_tokens
    if n == 0:
        raise ValueError("no text to time with")
    step = max(1, (n - p) // max(1, plan.batch - 1)) if n > p else 1
    return [[text_ids[(k * step + i) % n] for i in range(p)] for k in range(plan.batch)]


def round_rates(prefill_s: float, decode_s: float, plan: SpeedPlan) -> dict[str, float]:
    """One round's tokens/s (see the module docstring); NaN where the times give none."""
    nan = float("nan")
    decode_only = decode_s - prefill_s
    return {
        "prefill_tok_s": plan.batch * plan.prompt_tokens / prefill_s if prefill_s > 0 else nan,
        "decode_tok_s": (plan.batch * (plan.new_tokens - 1) / decode_only
                         if decode_only > 0 and plan.new_tokens > 1 else nan),
        "prefill_s": prefill_s, "decode_s": decode_s,
    }


def _median(xs: list[float]) -> float:
    ok = [x for x in xs if x == x]
    return statistics.median(ok) if ok else float("nan")


def speed_figures(bf16: list[dict[str, float]], scheme: list[dict[str, float]],
                  plan: SpeedPlan) -> dict[str, Any]:
    """The JSON's ``vllm.speed``: rounds (`round_rates`, bf16's and the scheme's, pairwise in
    time) -> each round's ratios, their median, and each engine's median and fastest rates."""
    out: dict[str, Any] = {"plan": asdict(plan), "rounds": len(scheme),
                           "statistic": "median over the rounds of scheme / bf16 in the same "
                                        "round"}
    for kind in ("decode", "prefill"):
        key = f"{kind}_tok_s"
        ratios = [s[key] / b[key] if b[key] > 0 else float("nan")
                  for b, s in zip(bf16, scheme)]
        out[f"{kind}_vs_bf16"] = _median(ratios)
        out[f"{kind}_ratios"] = ratios
        for who, rows in (("bf16", bf16), ("scheme", scheme)):
            vals = [r[key] for r in rows if r[key] == r[key]]
            out[f"{who}_{key}"] = _median(vals)
            out[f"{who}_{key}_fastest"] = max(vals) if vals else float("nan")
    out["times_s"] = {"bf16": [[r["prefill_s"], r["decode_s"]] for r in bf16],
                      "scheme": [[r["prefill_s"], r["decode_s"]] for r in scheme]}
    return out


def _one_round(engine: Any, prompts: list[list[int]], plan: SpeedPlan) -> dict[str, float]:
    pre = engine.time_round(prompts, 1, plan.round_timeout)
    dec = engine.time_round(prompts, plan.new_tokens, plan.round_timeout)
    return round_rates(pre, dec, plan)


def warm_up(engine: Any, prompts: list[list[int]], plan: SpeedPlan) -> None:
    """One untimed call, so that no timed round pays for a first call's allocations."""
    engine.time_round(prompts, 2, plan.round_timeout)


# After a call, an idle vLLM engine keeps its CPU busy for a moment: the first call timed on
# the other engine right after it ran up to 4x slower on 2 cores (a bf16 prefill of 1.0 s
# against 0.23 s, in both rounds of a scheme, so that it had no decode figure at all). Each
# round therefore starts once the other engine has been idle this long.
SETTLE_S = 1.0


def interleave(bf16: Any, scheme: Any, prompts: list[list[int]], plan: SpeedPlan,
               settle: float = SETTLE_S) -> dict[str, Any]:
    """Time ``plan.rounds`` rounds on each engine (`ServedEngine`s, both up; bf16 already
    warmed up), alternating which goes first, each after `settle` seconds of quiet, and
    return `speed_figures`."""
    warm_up(scheme, prompts, plan)
    got: dict[str, list[dict[str, float]]] = {"bf16": [], "scheme": []}
    for r in range(plan.rounds):
        order = (("bf16", bf16), ("scheme", scheme)) if r % 2 == 0 else \
            (("scheme", scheme), ("bf16", bf16))
        for who, eng in order:
            time.sleep(settle)
            got[who].append(_one_round(eng, prompts, plan))
    return speed_figures(got["bf16"], got["scheme"], plan)


class SpeedTimer:
    """The speed rounds of each scheme's engine against the bf16 engine kept up beside it."""

    def __init__(self, bf16: Any, text_ids: list[int], plan: SpeedPlan | None,
                 progress: Callable[[str], None]) -> None:
        self.bf16, self.plan, self.say = bf16, plan, progress
        self.prompts = timing_prompts(list(text_ids), plan) if plan and text_ids else []
        self.warm = False

    def time(self, label: str, eng: Any) -> dict[str, Any] | None:
        """`qforensics.whatif.speed.interleave`'s figures, or {"error": why} (the scheme's
        quality figures stand either way); None without a plan."""
        if self.plan is None or not self.prompts:
            return None
        p = self.plan
        self.say(f"vLLM: timing {label} against bf16, {p.rounds} interleaved rounds of "
                 f"{p.batch} prompts x {p.prompt_tokens} tokens, {p.new_tokens} new tokens")
        try:
            if not self.warm:
                warm_up(self.bf16, self.prompts, p)
                self.warm = True
            got = interleave(self.bf16, eng, self.prompts, p)
        except QForensicsError as exc:
            self.say(f"{label} (vLLM): speed not measured: {exc}")
            return {"error": f"speed not measured: {exc}"}
        self.say(f"{label} (vLLM): decode {got['decode_vs_bf16']:.2f}x bf16 "
                 f"({got['scheme_decode_tok_s']:.0f} vs {got['bf16_decode_tok_s']:.0f} "
                 f"tokens/s), prefill {got['prefill_vs_bf16']:.2f}x")
        return got


def speed_lines(schemes: list[Any]) -> list[str]:
    """The vLLM table's note on decode / prefill (how they were measured), and each scheme
    whose speed was not measured, with why."""
    plans = [s.vllm["speed"] for s in schemes if isinstance(s.vllm.get("speed"), dict)
             and "plan" in s.vllm["speed"]]
    out = []
    if plans:
        p, n = plans[0]["plan"], plans[0]["rounds"]
        out.append(f"decode / prefill: tokens/s as a ratio to bf16 through vLLM on this "
                   f"machine, batch {p['batch']} x {p['prompt_tokens']}-token prompts, "
                   f"{p['new_tokens']} greedy new tokens; median of {n} rounds interleaved "
                   "with the bf16 engine (a ratio from one CPU does not carry to another)")
    out += [f"  {s.scheme}: {s.vllm['speed']['error']}" for s in schemes
            if isinstance(s.vllm.get("speed"), dict) and "error" in s.vllm["speed"]]
    return out
