"""Silent-failure evidence read from one trace, without a reference run: damaged parameters
(from the module info capture records at attach), activations beyond what a layer's static
input scale can represent, activation quantization the modules record that zeroes most of
their input channels, and degenerated output (the silent precursors). Each item says what it
measured, the threshold it was held against and why that threshold (docs/analyze-json.md).
No torch import; no loop over channels.
"""

from __future__ import annotations

import numpy as np

from qforensics.analyze.findings import Evidence, Precursor, SchemeDamage
from qforensics.analyze.outliers import ChannelRow
from qforensics.analyze.thresholds import Thresholds
from qforensics.formats import FP8_MIN_SUBNORMAL
from qforensics.trace import schema
from qforensics.trace.moduleinfo import ModuleInfos, ParamHealth, StaticInput
from qforensics.trace.reader import Trace

__all__ = ["PARAM_FLAGS", "activation_scheme_evidence", "collect_evidence", "flag_parameters",
           "recorded_scheme",
           "output_evidence", "param_flag", "parameter_evidence", "static_range_evidence",
           "summarize_parameters"]

_CAP = 16


def _n(n: int, noun: str, verbs: tuple[str, str] | None = None) -> str:
    """'1 layer gets' / '3 layers get' (no verb when `verbs` is None)."""
    s = f"{n} {noun}" + ("" if n == 1 else "s")
    return s if verbs is None else f"{s} {verbs[0] if n == 1 else verbs[1]}"




def _corrupt(h: ParamHealth) -> bool:
    return bool(h.nan or h.inf or (h.is_scale and h.zero) or h.zero_point_out_of_range)


# why a parameter is listed, worst first (`param_flag`)
PARAM_FLAGS = ("nonfinite", "zero_scales", "zero_points", "mostly_zero", "few_levels",
               "dominated", "unreadable")


def param_flag(h: ParamHealth, th: Thresholds) -> str | None:
    """The worst of PARAM_FLAGS that holds for one parameter, None when nothing does."""
    if h.nan or h.inf:
        return "nonfinite"
    if h.is_scale and h.zero:
        return "zero_scales"
    if h.zero_point_out_of_range:
        return "zero_points"
    if h.zero_share > th.param_zero_share:
        return "mostly_zero"
    if h.levels and h.levels.levels_median <= th.param_levels:
        return "few_levels"
    if h.levels and h.levels.dominated_share >= th.param_dominated:
        return "dominated"
    return "unreadable" if h.error else None


def flag_parameters(infos: ModuleInfos, th: Thresholds) -> list[ParamHealth]:
    """Parameters worth showing, worst first: non-finite values, zero scales, zero points out of
    range, then weights that are mostly zeros, hold few levels per group, or whose group scales
    one weight dominates (`param_flag`); within a flag, the largest count or share first."""
    order = {
        "nonfinite": lambda h: -(h.nan + h.inf), "zero_scales": lambda h: -h.zero,
        "zero_points": lambda h: -h.zero_point_out_of_range,
        "mostly_zero": lambda h: -h.zero_share,
        "few_levels": lambda h: h.levels.levels_median,
        "dominated": lambda h: -h.levels.dominated_share, "unreadable": lambda h: 0,
    }
    flagged = []
    for h in infos.health:
        flag = param_flag(h, th)
        if flag is not None:
            flagged.append(((PARAM_FLAGS.index(flag), order[flag](h)), h))
    flagged.sort(key=lambda kv: (kv[0], kv[1].module, kv[1].param))
    return [h for _, h in flagged]


def summarize_parameters(infos: ModuleInfos, th: Thresholds) -> dict[str, int]:
    """Counts over every parameter tensor capture checked."""
    hs = [h for h in infos.health if not h.error]
    return {
        "checked": len(hs),
        "unreadable": infos.invalid + sum(1 for h in infos.health if h.error),
        "nonfinite": sum(1 for h in hs if h.nan or h.inf),
        "zero_scales": sum(1 for h in hs if h.is_scale and h.zero),
        "zero_points_out_of_range": sum(1 for h in hs if h.zero_point_out_of_range),
        "mostly_zero": sum(1 for h in hs if not h.is_scale and h.zero_share > th.param_zero_share),
        "few_levels": sum(1 for h in hs if h.levels and h.levels.levels_median <= th.param_levels),
        "dominated": sum(1 for h in hs if h.levels
                         and h.levels.dominated_share >= th.param_dominated),
        "static_input_scales": len(infos.static_inputs),
    }


def _where(h: ParamHealth) -> dict:
    d = {"module": h.module, "param": h.param, "numel": h.numel, "nan": h.nan, "inf": h.inf,
         "zero": h.zero}
    if h.first_nonfinite is not None:
        d["first_nonfinite"] = h.first_nonfinite.words()
    if h.first_zero is not None:
        d["first_zero"] = h.first_zero.words()
    return d


def parameter_evidence(infos: ModuleInfos, th: Thresholds) -> list[Evidence]:
    out: list[Evidence] = []
    bad = [h for h in infos.health if _corrupt(h)]
    if bad:
        first = bad[0]
        what = []
        if first.nan or first.inf:
            what.append(f"{first.nan} NaN / {first.inf} Inf")
        if first.is_scale and first.zero:
            what.append(f"{first.zero} zero scales")
        if first.zero_point_out_of_range:
            what.append(f"{first.zero_point_out_of_range} zero points out of range")
        where = first.first_nonfinite or first.first_zero or first.first_out_of_range
        tied = infos.tied_with(first.module, first.param)
        head = _n(len(bad), "parameter tensor", ("is", "are"))
        line = (f"{head} corrupt, first {first.module}.{first.param}: {', '.join(what)}"
                + (f" from {where.words()}" if where else "")
                + (f" (tied to {', '.join(tied)})" if tied else ""))
        out.append(Evidence("parameters_corrupt", "parameters", True, line, float(len(bad)), 1.0,
                            "(any)", sorted({h.module for h in bad})[:_CAP],
                            [_where(h) for h in bad[:_CAP]]))
    zeros = sorted((h for h in infos.health if not h.is_scale and h.numel and not _corrupt(h)
                    and h.zero_share > th.param_zero_share), key=lambda h: -h.zero_share)
    if zeros:
        w = zeros[0]
        head = _n(len(zeros), "weight tensor", ("is", "are"))
        out.append(Evidence(
            "parameters_mostly_zero", "parameters", True,
            f"{head} more than {th.param_zero_share:.0%} exact zeros (worst {w.module}."
            f"{w.param}: {w.zero_share:.1%}): a quantization scale far too coarse for the "
            "weights", float(len(zeros)), th.param_zero_share, "param_zero_share",
            [h.module for h in zeros][:_CAP],
            [{"module": h.module, "param": h.param, "zero_share": round(h.zero_share, 4)}
             for h in zeros[:_CAP]]))
    lv = [(h, h.levels) for h in infos.health if h.levels is not None]
    few = [(h, g) for h, g in lv if g.levels_median <= th.param_levels]
    if few:
        h0, g0 = few[0]
        head = _n(len(few), "weight tensor", ("holds", "hold"))
        out.append(Evidence(
            "parameters_few_levels", "parameters", True,
            f"{head} at most {th.param_levels:g} distinct values in the median group (e.g. "
            f"{h0.module}.{h0.param}: {g0.levels_median:g} per {g0.group_size} weights)",
            float(len(few)), th.param_levels, "param_levels", [h.module for h, _ in few][:_CAP],
            [{"module": h.module, "param": h.param, "levels_median": g.levels_median,
              "levels_min": g.levels_min, "group_size": g.group_size} for h, g in few[:_CAP]]))
    dom = [(h, g) for h, g in lv if g.dominated_share >= th.param_dominated]
    if dom:
        h0, g0 = dom[0]
        out.append(Evidence(
            "scales_dominated", "parameters", True,
            f"in {_n(len(dom), 'weight tensor')} at least {th.param_dominated:.0%} of the groups "
            f"have one weight at >= 2x every other (e.g. {h0.module}.{h0.param}: "
            f"{g0.dominated_share:.0%}): that weight sets the group's scale",
            float(len(dom)), th.param_dominated, "param_dominated",
            [h.module for h, _ in dom][:_CAP],
            [{"module": h.module, "param": h.param, "dominated_share": g.dominated_share}
             for h, g in dom[:_CAP]]))
    return out


def _static_one(st: StaticInput, row: ChannelRow | None, peak: float, th: Thresholds
                ) -> dict | None:
    d: dict = {"module": st.module, "input_scale": st.scale, "format": st.format,
               "range": st.range, "recorded_absmax": peak,
               "overrun": peak / st.range if st.range > 0 else float("inf")}
    if st.lo is not None and st.hi is not None:
        d.update(zero_point=st.zero_point, representable=[st.lo, st.hi])
    if st.kernel:
        d["kernel"] = st.kernel
    if row is not None and len(row.absmax):
        a = row.absmax
        over = np.nonzero(a > st.range)[0]
        order = over[np.argsort(-a[over])][:_CAP]
        d["step"] = int(row.rec["step"])
        d["channels_over"] = [{"channel": int(c), "absmax": float(a[c]),
                               "times_range": float(a[c] / st.range)} for c in order]
        d["channels_over_share"] = float(len(over) / len(a))
        sub = FP8_MIN_SUBNORMAL.get(st.format)
        tiny = st.scale * (sub / 2 if sub else 0.5)  # int8: below half a step rounds to 0
        d["channels_zero_share"] = float(np.mean(a < tiny))
        if row.tokens is not None and len(row.tokens):
            d["tokens_saturating_share"] = float(np.mean(row.tokens > st.range))
    return d


def static_range_evidence(infos: ModuleInfos, rows: dict[str, ChannelRow],
                          peaks: dict[str, float], th: Thresholds) -> list[Evidence]:
    """Layers with a static input scale whose recorded input goes beyond the scale's range
    (saturates) by `static_overrun` or more, or whose channels mostly round to zero."""
    items = []
    unused = [st for st in infos.static_inputs.values() if not st.applied]
    for name, st in infos.static_inputs.items():
        if not st.applied:
            continue  # the kernel does not quantize with it: nothing saturates against it
        peak = peaks.get(name)
        if peak is None or not np.isfinite(peak):
            continue
        d = _static_one(st, rows.get(name), float(peak), th)
        if d is not None:
            items.append(d)
    out: list[Evidence] = []
    over = [d for d in items if d["overrun"] >= th.static_overrun]
    over.sort(key=lambda d: -d["overrun"])
    if over:
        w = over[0]
        chans = w.get("channels_over") or []
        cw = ", ".join(f"{c['channel']} ({c['absmax']:.4g}, x{c['times_range']:.3g})"
                       for c in chans[:3])
        head = _n(len(over), "layer", ("gets", "get"))
        line = (f"{head} inputs beyond what their static input_scale can "
                f"represent; worst {w['module']}: {_range_text(w)}, recorded |input| up to "
                f"{w['recorded_absmax']:.4g} (x{w['overrun']:.3g})"
                + (f"; channels {cw}" if cw else "")
                + (f"; {w['tokens_saturating_share']:.0%} of tokens saturate"
                   if "tokens_saturating_share" in w else ""))
        out.append(Evidence("static_range_overrun", "activations", True, line,
                            float(w["overrun"]), th.static_overrun, "static_overrun",
                            [d["module"] for d in over][:_CAP], over[:_CAP]))
    if unused:
        u = unused[0]
        out.append(Evidence(
            "static_scale_unused", "activations", False,
            f"{_n(len(unused), 'layer', ('carries', 'carry'))} a static input_scale that their kernel does not "
            f"apply, so it was not checked (e.g. {u.module}: {u.kernel or 'its kernel'}: "
            f"{u.why or 'not applied'})", float(len(unused)), 0.0, "",
            [x.module for x in unused][:_CAP],
            [{"module": x.module, "input_scale": x.scale, "kernel": x.kernel, "why": x.why}
             for x in unused[:_CAP]]))
    zero = [d for d in items if d.get("channels_zero_share", 0.0) >= th.unsafe_fraction]
    if zero:
        z = max(zero, key=lambda d: d["channels_zero_share"])
        out.append(Evidence(
            "static_range_underflow", "activations", True,
            f"{_n(len(zero), 'layer', ('has', 'have'))} a static input_scale so large that most "
            "input channels "
            f"round to zero (worst {z['module']}: {z['channels_zero_share']:.0%} of channels)",
            float(z["channels_zero_share"]), th.unsafe_fraction, "unsafe_fraction",
            [d["module"] for d in zero][:_CAP], zero[:_CAP]))
    return out


def _range_text(d: dict) -> str:
    """'input_scale 0.05 x 448 = 22.4', or for asymmetric INT8 'input_scale 0.011 with zero
    point 4 represents [-1.48, 1.38]'."""
    s = d["input_scale"]
    if "representable" in d:
        lo, hi = d["representable"]
        return (f"input_scale {s:.4g} with zero point {d.get('zero_point')} represents "
                f"[{lo:.4g}, {hi:.4g}]")
    r = d["range"]
    return f"input_scale {s:.4g} x {(r / s if s else float('nan')):g} = {r:.4g}"


def recorded_scheme(q: dict) -> str | None:
    """The damage scheme matching a module's recorded activation quantization, if any."""
    if q.get("target") != "activations" or "act_format" in q:
        return None  # static scales are judged by static_range_evidence
    fmt = str(q.get("format", "")).replace("-nosat", "")
    return fmt or None


def activation_scheme_evidence(infos: ModuleInfos, damage: list[SchemeDamage],
                               th: Thresholds) -> list[Evidence]:
    """Modules that record the activation quantization they run with, where that scheme,
    applied to the input they recorded, zeroes at least `unsafe_fraction` of the channels."""
    by = {(d.module, d.scheme): d for d in damage}
    hit = []
    for name, q in infos.quant.items():
        sch = recorded_scheme(q)
        d = by.get((name, sch)) if sch else None
        if d is not None and d.fraction >= th.unsafe_fraction:
            hit.append(d)
    if not hit:
        return []
    hit.sort(key=lambda d: -d.fraction)
    w = hit[0]
    return [Evidence(
        "activation_scheme_zeroes", "activations", True,
        f"{_n(len(hit), 'module', ('quantizes', 'quantize'))} their input with {w.scheme}, "
        "which on the recorded inputs "
        f"rounds at least {th.unsafe_fraction:.0%} of the channels to zero (worst {w.module}: "
        f"{w.channels_zeroed} of {w.channels_total})", float(w.fraction), th.unsafe_fraction,
        "unsafe_fraction", [d.module for d in hit][:_CAP],
        [{"module": d.module, "scheme": d.scheme, "channels_zeroed": d.channels_zeroed,
          "channels_total": d.channels_total, "scale": d.scale} for d in hit[:_CAP]])]


_OUT_TH = {"logits_growth": "logits_growth_factor", "entropy_collapse": "entropy_low",
           "repeat_loop": "repeat_tokens", "uniform_logits": "entropy_uniform",
           "extreme_logits": "logits_extreme", "degenerate_ids": "degenerate_steps",
           "outcome": "agreement_min"}


def output_evidence(precursors: list[Precursor], th: Thresholds) -> list[Evidence]:
    """The silent precursors (degenerated output) as evidence."""
    out = []
    for p in precursors:
        if not p.silent:
            continue
        name = _OUT_TH.get(p.kind, "")
        out.append(Evidence(p.kind, "output", True, p.line, p.value,
                            float(getattr(th, name, float("nan"))) if name else float("nan"),
                            name))
    return out


def _input_peaks(trace: Trace, names: set[str]) -> dict[str, float]:
    """Largest finite |input| each named module recorded over the whole trace."""
    mods = trace.module_names
    ids = np.nonzero(np.isin(mods, list(names)))[0]
    if not len(ids):
        return {}
    cols = trace.record_columns(["module_id", "io", "absmax"])
    sel = np.isin(cols["module_id"], ids) & (cols["io"] == schema.IO_INPUT) & np.isfinite(
        cols["absmax"])
    if not sel.any():
        return {}
    df = {"m": cols["module_id"][sel], "a": cols["absmax"][sel].astype(np.float64)}
    order = np.argsort(df["m"], kind="stable")
    m, a = df["m"][order], df["a"][order]
    starts = np.r_[0, np.nonzero(np.diff(m))[0] + 1]
    peak = np.maximum.reduceat(a, starts)
    return {str(mods[int(m[i])]): float(p) for i, p in zip(starts, peak)}


def collect_evidence(trace: Trace, infos: ModuleInfos, rows: list[ChannelRow],
                     damage: list[SchemeDamage], precursors: list[Precursor],
                     th: Thresholds) -> list[Evidence]:
    """Every evidence item, parameters first, then activations, then the output."""
    out = parameter_evidence(infos, th)
    if infos.static_inputs:
        by_name = {r.module: r for r in rows}
        peaks = _input_peaks(trace, set(infos.static_inputs))
        out += static_range_evidence(infos, by_name, peaks, th)
    out += activation_scheme_evidence(infos, damage, th)
    out += output_evidence(precursors, th)
    return out
