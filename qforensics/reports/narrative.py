"""The words of the report: the causal chain (one paragraph); the recommendations are in
`qforensics.reports.recommendations`.

Text is built as a list of `Segment`s (qforensics.reports.segments: plain text plus a style) so
the template can emphasize module names and numbers while escaping every piece: nothing here is
HTML, and trace strings stay plain text. No torch import.
"""

from __future__ import annotations

import math
from collections import Counter

from qforensics.analyze.findings import (
    PASSED,
    DiffFindings,
    Findings,
    UnsafeModules,
)
from qforensics.analyze.quantization import ModuleQuant
from qforensics.analyze.views import format_limit
from qforensics.reports.facts import Health, Outcome, fmt_num
from qforensics.reports.segments import Segment
from qforensics.reports.segments import code as _c
from qforensics.reports.segments import joined as _join
from qforensics.reports.segments import num as _n
from qforensics.reports.segments import plain as _t

__all__ = [
    "Segment",
    "active_scheme",
    "causal_chain",
    "format_limit",
    "scheme_key",
]


def active_scheme(quant: dict[str, ModuleQuant], outcome: Outcome, target: str) -> str | None:
    """The most common quantization format of one target among the modules (else the
    scenario's recorded scheme)."""
    c = Counter(q.format for q in quant.values() if q.target == target)
    if c:
        return c.most_common(1)[0][0]
    return outcome.activations if target == "activations" else outcome.weights


def scheme_key(fmt: str) -> str:
    """'fp8-e4m3-nosat' -> 'fp8-e4m3' (the analyzer's damage scheme names)."""
    return fmt.replace("-nosat", "").replace("e4m3fn", "e4m3")


def _step_word(step: int) -> str:
    return "the prefill" if step == 0 else f"decode step {step}"


def _repeated_unit(text: str) -> tuple[str, int] | None:
    """'abab...' -> ('ab', k) when the text is one short unit repeated at least 3 times."""
    n = len(text)
    for size in range(1, min(40, n // 3) + 1):
        if n % size == 0 and text[:size] * (n // size) == text:
            return text[:size], n // size
    return None


def _quoted(text: str, n: int = 140) -> str:
    """A short quoted excerpt of generated text; a repeated token reads "tok" x 32."""
    rep = _repeated_unit(text)
    if rep is not None:
        unit, k = rep
        return f"\u201c{' '.join(unit.split()) or repr(unit)}\u201d \u00d7 {k}"
    t = " ".join(text.split()) if text.strip() else repr(text)
    return "\u201c" + (t if len(t) <= n else t[: n - 3] + "...") + "\u201d"


def _unsafe_for(findings: Findings, scheme: str) -> UnsafeModules | None:
    for u in findings.unsafe:
        if u.scheme == scheme:
            return u
    return None


def _damage_for(findings: Findings, module: str, scheme: str):
    for d in findings.damage:
        if d.module == module and d.scheme == scheme:
            return d
    return None


def causal_chain(findings: Findings, quant: dict[str, ModuleQuant], health: Health,
                 outcome: Outcome, env: dict, diff: DiffFindings | None = None
                 ) -> list[Segment]:
    """One paragraph: which step, which module, which channels, why they break the scheme,
    what it did to the output."""
    s: list[Segment] = []
    fn = findings.first_nonfinite
    th_ratio = findings.thresholds.get("ratio", 20.0)
    if fn is not None:
        kind = {"nan": "NaN", "inf": "Inf", "nan+inf": "NaN and Inf"}.get(fn.kind, fn.kind)
        bad_n = fn.nan_count + fn.inf_count
        if fn.is_gap:
            g = fn.producer
            s += [_t(f"At step {fn.step} ({_step_word(fn.step)}), the first {kind} is already in "
                     "the input of call "), _n(str(fn.call_index)), _t(" ("), _c(g.first_bad_module),
                  _t("): an op the capture does not hook, between "),
                  _c(g.last_finite_module or "the start of the step"), _t(" and "),
                  _c(g.first_bad_module), _t(", produced it; "), _c(g.first_bad_module),
                  _t(" only passed it on. ")]
        cause = findings.cause
        if cause is not None and cause.kind == "corrupted_parameters":
            if not fn.is_gap:
                s += [_t(f"At step {fn.step} ({_step_word(fn.step)}), call "),
                      _n(str(fn.call_index)), _t(", "), _c(fn.module),
                      _t(" turned finite input into "), Segment(kind, "bad"), _t(" ("),
                      _n(bad_n), _t(" of "), _n(fn.numel), _t(" output values). ")]
            s += [_t("The cause is corrupted parameters, not the input: ")] + _join(
                [[_c(t.get("words", t.get("param", "?")))] for t in cause.tensors]) + [_t(". ")]
        elif fn.is_gap:
            pass
        elif cause is not None and cause.kind == "compute_overflow":
            s += [_t(f"At step {fn.step} ({_step_word(fn.step)}), call "), _n(str(fn.call_index)),
                  _t(", "), _c(fn.module), _t(" turned finite input into "),
                  Segment(kind, "bad"), _t(". Its parameters are finite and its input stays "
                                           "below "), _n(cause.limit), _t(": the "),
                  _c(cause.format or "fp16"), _t(" compute dtype overflowed inside it. ")]
        else:
            s += [_t(f"At step {fn.step} ({_step_word(fn.step)}), call "), _n(str(fn.call_index)),
                  _t(", "), _c(fn.module), _t(" turned finite input into "),
                  Segment(kind, "bad"), _t(" ("), _n(bad_n), _t(" of "), _n(fn.numel),
                  _t(" output values). ")]
            mine = sorted((o for o in findings.outliers if o.module == fn.module
                           and o.step == fn.step and o.io == 0),
                          key=lambda o: -o.absmax)[:3]
            if mine:
                parts = [[_t("channel "), _n(str(o.channel)), _t(" at "), _n(o.absmax),
                          _t(" ("), _n(f"{fmt_num(o.ratio_to_median)}x"), _t(" the median)")]
                         for o in mine]
                s += [_t(f"Its input held {len(mine)} channel{'s' if len(mine) > 1 else ''} far "
                         "outside the rest: ")] + _join(parts) + [
                    _t(", against a median channel absmax of "), _n(mine[0].median_absmax),
                    _t(". ")]
            elif fn.input_absmax is not None:
                s += [_t("Its input ranged from "), _n(fn.input_min), _t(" to "),
                      _n(fn.input_max), _t(". ")]
            s += _why_scheme(findings, fn.module, mine, quant, env)
        sp = fn.spread
        s += [_t(f"The {kind} then reached "), _n(sp.n_modules), _t(" of "),
              _n(sp.n_modules_total), _t(" modules and the logits of "),
              _n(sp.logits_nonfinite_steps), _t(" of "), _n(sp.n_steps_after), _t(" steps. ")]
        nl = findings.nonfinite_logits
        if nl is not None:
            s += [_t(f"At step {nl.step} the logits held "), _n(nl.nan_count + nl.inf_count),
                  _t(" non-finite values"), _t(f" ({fmt_num(nl.per_row)} per row)")
                  if nl.per_row is not None else _t(""), _t("; " + nl.symptom + ". ")]
    else:
        lead = [e for e in findings.evidence if e.suspect]
        if findings.verdict.status == PASSED:
            s += [_t(f"No NaN or Inf and no sign of damage in {findings.n_steps} steps. ")]
        else:
            s += [_t(f"No NaN or Inf in {findings.n_steps} steps, yet the run looks broken: ")]
            s += [_t(lead[0].line + ". ") if lead else _t(findings.verdict.line + ". ")]
            for e in lead[1:3]:
                s += [_t(e.line[0].upper() + e.line[1:] + ". ")]
        said = {e.kind for e in lead[:3]}
        s += _silent_causes(findings, quant, health, outcome, th_ratio, said)
    s += _output_sentence(outcome, findings)
    ref = findings.reference
    if ref is not None:
        s += [_t("Against the reference trace: " + ref.line.split(": ", 1)[-1] + ". ")]
    elif diff is not None and diff.first_jump is not None:
        j = diff.first_jump
        s += [_t("Against the reference trace, the first jump in divergence is at "), _c(j.module),
              _t(f" (step {j.step}, score "), _n(j.score), _t("). ")]
    return s


def _why_scheme(findings: Findings, module: str, mine: list, quant: dict[str, ModuleQuant],
                env: dict) -> list[Segment]:
    """Why the producer's input breaks its scheme, with numbers."""
    q = quant.get(module)
    out: list[Segment] = []
    peak = mine[0].absmax if mine else None
    fmt = q.format if q else None
    if fmt and fmt.startswith("fp8") or (not fmt and mine and any(
            lim.startswith("fp8") for o in mine for lim in o.limits)):
        name, limit = format_limit(fmt or next(lim for o in mine for lim in o.limits
                                               if lim.startswith("fp8")))
        over = [o for o in mine if o.absmax > limit]
        if q:
            how = ("without saturation" if "nosat" in q.format else "with saturation")
            out += [_c(module), _t(f" casts its {q.target or 'input'} to {name} {how} (module "
                                   "quant info "), _c(q.format), _t("). ")]
        out += [_t(f"{name}'s largest finite value is "), _n(limit)]
        if over:
            out += [_t(": ")] + _join([[_t("channel "), _n(str(o.channel)), _t(" is "),
                                        _n(f"{o.absmax / limit:.1f}x"), _t(" over it")]
                                       for o in over])
        if q is None or "nosat" in q.format:
            out += [_t(", and a non-saturating cast turns such values into NaN (e4m3fn has no "
                       "Inf). ")]
        else:
            out += [_t(", so such values are clipped to it. ")]
        cast = env.get("fp8_cast") if isinstance(env.get("fp8_cast"), dict) else {}
        if isinstance(cast.get("e4m3fn"), str) and q is not None and "nosat" in q.format:
            out += [_t("(torch's own e4m3fn cast on the recorded machine behaves as "),
                    _c(cast["e4m3fn"][:40]), _t("; the failing path used a non-saturating "
                                                 "conversion.) ")]
    elif fmt and fmt.startswith("int"):
        d = _damage_for(findings, module, scheme_key(fmt))
        out += [_c(module), _t(" quantizes its " + (q.target or "input") + " with "),
                _c(fmt), _t(". ")]
        if d is not None:
            out += [_t("That scale is "), _n(d.scale), _t(": "), _n(d.channels_zeroed),
                    _t(" of "), _n(d.channels_total), _t(" channels fall below half of it and "
                                                         "round to 0. ")]
    d4 = _damage_for(findings, module, "int4-per-tensor")
    if d4 is not None and peak is not None and d4.channels_zeroed:
        out += [_t("The same outliers would wreck an INT4 per-tensor scale too: "), _n(d4.scale),
                _t(", rounding "), _n(d4.channels_zeroed), _t(" of "), _n(d4.channels_total),
                _t(" channels to 0. ")]
    return out


def _silent_causes(findings: Findings, quant: dict[str, ModuleQuant], health: Health,
                   outcome: Outcome, th_ratio: float, said: set[str] = frozenset()
                   ) -> list[Segment]:
    out: list[Segment] = []
    zero_rows = [r for r in health.rows if r.problem.endswith("exact zeros")
                 ] if "parameters_mostly_zero" not in said else []
    wfmt = active_scheme(quant, outcome, "weights")
    if zero_rows:
        worst = zero_rows[0]
        out += [_n(health.mostly_zero), _t(" parameter tensors have more than half their values "
                                            "exactly 0 (worst "), _c(worst.module),
                _t(" "), _c(worst.param), _t(": "), _n(f"{worst.zero_fraction:.1%}"),
                _t("), the signature of weights quantized with a scale too coarse for them"),
                _t(" (") if wfmt else _t(". ")]
        if wfmt:
            out += [_c(wfmt), _t("). ")]
    afmt = active_scheme(quant, outcome, "activations")
    if afmt and "activation_scheme_zeroes" not in said and "static_range_overrun" not in said:
        u = _unsafe_for(findings, scheme_key(afmt))
        n_act = sum(1 for q in quant.values() if q.target == "activations")
        out += [_t("Activations run through "), _c(afmt)]
        out += [_t(f" in {n_act} modules")] if n_act else []
        if u is not None and u.n_unsafe and u.modules:
            w = u.modules[0]
            out += [_t("; the analyzer predicts that scheme zeroes at least half the input "
                       "channels of "), _n(u.n_unsafe), _t(" of "), _n(u.n_modules),
                    _t(" modules (worst "), _c(w.module), _t(": scale "), _n(w.scale), _t(", "),
                    _n(w.channels_zeroed), _t(" of "), _n(w.channels_total),
                    _t(" channels round to 0). ")]
        else:
            out += [_t(". ")]
    if findings.outliers:
        o = max(findings.outliers, key=lambda o: o.absmax if math.isfinite(o.absmax) else -1)
        out += [_t("The largest input outlier is channel "), _n(str(o.channel)), _t(" of "),
                _c(o.module), _t(f" at step {o.step}: "), _n(o.absmax), _t(" ("),
                _n(f"{fmt_num(o.ratio_to_median)}x"), _t(" the median channel). ")]
    if findings.persistent:
        p = findings.persistent[0]
        out += [_t("Hidden dimension "), _n(str(p.dim)), _t(" stands out in "), _n(p.modules),
                _t(" modules (up to "), _n(p.max_absmax), _t("). ")]
    return out


def _output_sentence(outcome: Outcome, findings: Findings) -> list[Segment]:
    if outcome.text is None:
        return []
    out = [_t("The run generated "), _c(_quoted(outcome.text))]
    if outcome.top1_agreement is not None:
        out += [_t(" (top-1 agreement with the reference "),
                _n(f"{outcome.top1_agreement:.0%}"), _t(")")]
    if outcome.reference_text is not None and outcome.reference_text != outcome.text:
        out += [_t("; the reference says "),
                _c(_quoted(outcome.reference_text))]
    return out + [_t(".")]
