"""The report's recommendations: actions tied to the findings, each with the command that
verifies it (built from the same text segments as the causal chain). No torch import.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field

from qforensics.analyze.findings import FAILED, PASSED, Findings, UnsafeModules
from qforensics.analyze.quantization import ModuleQuant
from qforensics.reports.facts import Health, Outcome
from qforensics.reports.narrative import active_scheme, format_limit, scheme_key
from qforensics.reports.replay_result import ReplaySummary
from qforensics.reports.segments import Segment
from qforensics.reports.segments import code as _c
from qforensics.reports.segments import joined as _join
from qforensics.reports.segments import num as _n
from qforensics.reports.segments import plain as _t

__all__ = ["Recommendation", "recommendations"]


@dataclass
class Recommendation:
    id: str
    title: str
    why: list[Segment]
    commands: list[str] = field(default_factory=list)


def _q(s: str) -> str:
    return shlex.quote(s)


def _salient_pct(n_channels: int, total: int) -> str:
    if total <= 0:
        return "1%"
    pct = max(1, math.ceil(100.0 * n_channels / total))
    return f"{pct}%"


def _best_group(findings: Findings, bits: str = "int4") -> UnsafeModules | None:
    cands = [u for u in findings.unsafe if u.scheme.startswith(f"{bits}-g")]
    if not cands:
        return None

    def size(u: UnsafeModules) -> int:
        try:
            return int(u.scheme.split("-g")[1])
        except (IndexError, ValueError):
            return 0
    return min(cands, key=lambda u: (u.n_unsafe, -size(u)))


def recommendations(findings: Findings, quant: dict[str, ModuleQuant], health: Health,
                    outcome: Outcome, env: dict, *, trace_arg: str,
                    reference_arg: str | None = None, replay: ReplaySummary | None = None
                    ) -> list[Recommendation]:
    """Actions tied to the findings, each with the command that verifies it."""
    recs: list[Recommendation] = []
    T = _q(trace_arg)
    fn = findings.first_nonfinite
    producer = fn.producer_module if fn is not None else None
    pq = quant.get(producer) if producer else None
    afmt = active_scheme(quant, outcome, "activations")
    wfmt = active_scheme(quant, outcome, "weights")
    focus = producer or (findings.outliers[0].module if findings.outliers else None)
    mine = [o for o in findings.outliers if o.module == focus and o.io == 0]
    chans = sorted({o.channel for o in mine})
    total = mine[0].channels_total if mine else 0

    corrupt = findings.cause is not None and findings.cause.kind == "corrupted_parameters"
    if corrupt:
        names = [t.get("words", "?") for t in findings.cause.tensors][:3]  # type: ignore[union-attr]
        recs.append(Recommendation(
            "rec-params", "Replace the corrupted parameters",
            [_t("The producer's own parameters hold non-finite values or zero scales: ")]
            + _join([[_c(n)] for n in names])
            + [_t(". No scheme or outlier protection fixes that: reload or re-quantize the "
                  "checkpoint, and scan it for other broken tensors before loading.")],
            ["qforensics scan path/to/checkpoint", f"qforensics analyze {T}"]))
    fp8_over = not corrupt and ((pq is not None and pq.format.startswith("fp8")) or any(
        lim.startswith("fp8") for o in mine for lim in o.limits))
    if fn is not None and fp8_over:
        name, limit = format_limit(pq.format if pq else "fp8-e4m3")
        recs.append(Recommendation(
            "rec-fp8", f"Make the {name} cast of {producer or 'the producer'} safe",
            [_t("Use a saturating cast or a dynamic per-tensor scale (amax / "), _n(limit),
             _t(") for the input of "), _c(producer or "-"),
             _t(f": its outliers exceed {name}'s largest value, and a static, non-saturating "
                "cast turns them into NaN. The what-if predicts the damage of the dynamic-scale "
                "scheme on the recorded ranges.")],
            [f"qforensics whatif {T} --scheme fp8-e4m3-dynamic"]))
    if chans and focus and not corrupt:
        scheme = afmt or wfmt or "int4-g128"
        pct = _salient_pct(len(chans), total)
        recs.append(Recommendation(
            "rec-salient", "Keep the outlier channels in FP16",
            [_t("Keep input channel" + ("s " if len(chans) > 1 else " ")),
             _n(", ".join(str(c) for c in chans[:12]) + (" ..." if len(chans) > 12 else "")),
             _t(" of "), _c(focus), _t(" in FP16 (" + str(len(chans)) + " of "),
             _n(total), _t(f" channels; a {pct} salient-channel budget covers them) and quantize "
                           "the rest.")],
            [f"qforensics whatif {T} --scheme {_q(scheme_key(scheme))} --keep-salient {pct}"]))
    per_tensor = [u for u in findings.unsafe if "per-tensor" in u.scheme and u.n_unsafe]
    weights_zeroed = health.mostly_zero > 0
    int_active = any(f and f.startswith("int") for f in (afmt, wfmt))
    no_active = not afmt and not wfmt
    if not corrupt and (weights_zeroed or (int_active and any(
            f and "per-tensor" in f for f in (afmt, wfmt))) or (no_active and per_tensor)):
        g = _best_group(findings)
        gname = g.scheme if g is not None else "int4-g128"
        why = [_t("One scale per tensor is set by the largest value, so everything small rounds "
                  "to 0. ")]
        if per_tensor:
            u = per_tensor[0]
            why += [_c(u.scheme), _t(" is predicted unsafe for "), _n(u.n_unsafe), _t(" of "),
                    _n(u.n_modules), _t(" modules")]
            if g is not None:
                why += [_t("; "), _c(g.scheme), _t(" for "), _n(g.n_unsafe)]
            why += [_t(". ")]
        if weights_zeroed:
            why += [_n(health.mostly_zero), _t(" parameter tensors are more than half zeros. ")]
        why += [_t("Use per-group scales (group size "),
                _n(gname.split("-g")[1] if "-g" in gname else "128"),
                _t(") and compare the predicted damage.")]
        recs.append(Recommendation("rec-group", f"Use per-group scales ({gname})", why,
                                   [f"qforensics whatif {T} --scheme {_q(gname)}",
                                    f"qforensics whatif {T} --scheme {_q(gname)} --keep-salient 1%"]))
    argv = env.get("argv")
    run_cmd = (" ".join(_q(str(a)) for a in argv[:20]) if isinstance(argv, list) and argv
               and all(isinstance(a, str) for a in argv) else "python serve_once.py")
    if not run_cmd.startswith("python"):
        run_cmd = "python " + run_cmd
    if findings.verdict.status == FAILED:
        recs.append(Recommendation(
            "rec-guard", "Add the runtime NaN/Inf guard",
            [_t("Run the model under the qforensics runtime guard so a non-finite output trips a "
                "fallback to the unquantized path (with a circuit breaker) instead of emitting "
                "garbage tokens; the guard's trips are recorded in the trace, and the analysis "
                "shows whether the output stayed finite.")],
            [f"qforensics record --guard -o after.h5 -- {run_cmd}",
             "qforensics analyze after.h5"]))
    if fn is not None and findings.snapshots and replay is None:
        recs.append(Recommendation(
            "rec-replay", "Replay the producer's kernel on the kept snapshot",
            [_t("The trace kept the tensors of call "), _n(str(fn.call_index)),
             _t("; replay them under compute-sanitizer (or the CPU emulation) to tell a kernel "
                "bug from a numeric overflow, and attach the result to this report.")],
            [f"qforensics replay {T} --call {fn.call_index} --json replay.json",
             f"qforensics report {T} -o incident.html --replay replay.json"]))
    if reference_arg is None and findings.verdict.status != PASSED:
        recs.append(Recommendation(
            "rec-reference", "Compare with a reference run",
            [_t("Capture the same prompt unquantized (FP16) and diff the two traces: the first "
                "module whose statistics jump is where the damage starts.")],
            [f"qforensics record -o ref.h5 -- {run_cmd}",
             f"qforensics report {T} -o incident.html --reference ref.h5"]))
    elif reference_arg is not None:
        recs.append(Recommendation(
            "rec-diff", "Re-run the diff after the fix",
            [_t("The reference trace is given; after applying a fix, the diff should show no "
                "jump.")],
            [f"qforensics diff {_q(reference_arg)} after.h5"]))
    recs.append(Recommendation(
        "rec-analyze", "Verify",
        [_t("After any change, capture again and analyze: the verdict line should read PASSED.")],
        [f"qforensics analyze {T}"]))
    return recs
