"""Why the producer of the first NaN/Inf went non-finite, and what non-finite logits did to
decoding.

Causes, checked in this order (the first that the trace shows wins, so an outlier is never
blamed when the producer's own parameters are corrupt):

(d) unhooked op: the value was already in a hooked call's input;
(a) corrupted parameters: the producer's weight, scale or zero point holds NaN/Inf, a scale is
    zero, or a zero point is out of range (from the health capture records at attach); or a
    weight or scale finite at attach that the parameter watch saw holding NaN/Inf at or before
    the failing step (/param_watch: overwritten during the run);
(c) compute-dtype overflow: finite input and parameters, an Inf in a float16 output whose input
    stayed below 65,504 (the product overflowed, not the input);
(b) activation outlier against a format's range: input channels beyond the limit of the format
    the producer records for its activations (FP8 448 / 57344, a static input_scale x max), or
    beyond FP8 / FP16 limits the outlier scan flagged.

No torch import.
"""

from __future__ import annotations

import numpy as np

from qforensics.analyze.findings import (
    Cause,
    FirstNonfinite,
    NonfiniteLogits,
    OutlierChannel,
)
from qforensics.formats import FORMAT_LIMITS
from qforensics.trace import schema
from qforensics.trace.moduleinfo import ModuleInfos, ParamHealth
from qforensics.trace.reader import Trace
from qforensics.trace.table import Table

__all__ = ["classify_cause", "describe_nonfinite_logits"]

_FP16 = schema.DTYPE_CODES["float16"]


def _corrupt(h: ParamHealth) -> bool:
    return bool(h.nan or h.inf or (h.is_scale and h.zero) or h.zero_point_out_of_range)


def _tensor(h: ParamHealth, infos: ModuleInfos) -> dict:
    d: dict = {"param": h.param, "nan": h.nan, "inf": h.inf, "numel": h.numel}
    words = []
    if h.nan or h.inf:
        words.append(f"{h.nan} NaN" if h.nan else "")
        words.append(f"{h.inf} Inf" if h.inf else "")
        if h.first_nonfinite is not None:
            d["first_nonfinite"] = h.first_nonfinite.words()
            d["row"] = h.first_nonfinite.row
            if h.first_nonfinite.group is not None:
                d["group"] = h.first_nonfinite.group
    if h.is_scale and h.zero:
        d["zero_scales"] = h.zero
        words.append(f"{h.zero} zero scales")
        if h.first_zero is not None:
            d["first_zero"] = h.first_zero.words()
    if h.zero_point_out_of_range:
        d["zero_points_out_of_range"] = h.zero_point_out_of_range
        words.append(f"{h.zero_point_out_of_range} zero points out of range")
    tied = infos.tied_with(h.module, h.param)
    if tied:
        d["tied_with"] = tied
    where = h.first_nonfinite or h.first_zero or h.first_out_of_range
    d["words"] = (f"{h.module}.{h.param}" + (f" (tied to {', '.join(tied)})" if tied else "")
                  + f": {' and '.join(w for w in words if w)}"
                  + (f", first at {where.words()}" if where else ""))
    return d


def _watch_rows(trace: Trace) -> Table | None:
    try:
        t = trace.param_watch
    except Exception:  # noqa: BLE001 - a damaged table: no watch evidence
        return None
    return t if len(t) else None


def _overwritten(w: Table, i: int, infos: ModuleInfos, first_step: int) -> dict:
    """One /param_watch row as a `corrupted_parameters` tensor entry, with its words."""
    module, param = str(w["module"][i]), str(w["param"][i])
    nan, inf = int(w["nan"][i]), int(w["inf"][i])
    n_rows = int(w["n_rows"][i])
    rows = [int(r) for r in w["rows"][i] if r >= 0]
    step, last = int(w["step"][i]), int(w["last_finite"][i])
    d: dict = {"param": param, "nan": nan, "inf": inf, "numel": int(w["numel"][i]),
               "rows": rows, "n_rows": n_rows, "first_seen_step": step,
               "last_finite_step": last, "during_run": True, "trigger": str(w["trigger"][i])}
    if rows:
        d["row"] = rows[0]
    if int(w["group"][i]) >= 0:
        d["group"] = int(w["group"][i])
    if int(w["col"][i]) >= 0:
        d["col"] = int(w["col"][i])
    tied = infos.tied_with(module, param)
    if tied:
        d["tied_with"] = tied
    leaf = param.rsplit(".", 1)[-1]
    kind = "scale" if ParamHealth(module, param, 0).is_scale else (
        "bias" if leaf == "bias" else "weight")
    what = " and ".join(x for x in ("NaN" if nan else "", "Inf" if inf else "") if x)
    where = (f"row {rows[0]}" if n_rows == 1 else
             f"rows {', '.join(map(str, rows))}" + (f" and {n_rows - len(rows)} more"
                                                    if n_rows > len(rows) else ""))
    if "group" in d:
        where += f" (group {d['group']})"
    at_attach = next((h for h in infos.health if h.module == module and h.param == param), None)
    then = ("finite at attach" if at_attach is not None and not _corrupt(at_attach)
            else "not checked at attach")
    seen = f"first seen at step {step}"
    if last >= 0:
        seen += f"; the check at step {last} read it finite"
    if step > first_step:
        seen += f", after the first bad step {first_step}"
    d["words"] = (f"{kind} {module}.{param}" + (f" (tied to {', '.join(tied)})" if tied else "")
                  + f" {where} overwritten with {what} during the run ({then}; {seen})")
    return d


def _watched(w: Table | None, infos: ModuleInfos, first_step: int, *, modules: set[str],
             late: bool = False) -> list[dict]:
    """Tensors of `modules` the parameter watch saw non-finite at or before `first_step`
    (`late`: after it, but not read finite at or after it), finite at attach or not checked
    then (a tensor corrupt at attach is the health branch's)."""
    if w is None:
        return []
    step, last = w["step"], w["last_finite"]
    when = (step > first_step) & (last < first_step) if late else step <= first_step
    out = []
    for i in np.nonzero(when)[0].tolist():
        module, param = str(w["module"][i]), str(w["param"][i])
        names = {f"{module}.{param}", *infos.tied_with(module, param)}
        if not any(n.rsplit(".", 1)[0] in modules for n in names):
            continue
        h = next((h for h in infos.health if h.module == module and h.param == param), None)
        if h is not None and _corrupt(h):
            continue
        out.append(_overwritten(w, i, infos, first_step))
    return out


def _format_limit(q: dict, static_range: float | None) -> tuple[str, float] | None:
    if static_range is not None:
        return ("static input_scale range", static_range)
    if q.get("target") != "activations":
        return None
    fmt = str(q.get("format", ""))
    for name in ("fp8-e4m3", "fp8-e5m2"):
        if fmt.startswith(name) and "dynamic" not in fmt:
            return (name, FORMAT_LIMITS[name])
    return None


def classify_cause(trace: Trace, recs: Table, first: FirstNonfinite, infos: ModuleInfos,
                   outliers: list[OutlierChannel]) -> Cause:
    module = first.module
    if first.is_gap:
        gap = first.producer
        hooked = set(trace.module_names.tolist()) - infos.unhooked
        # a corrupt tensor of a module capture does not hook (the token embedding, described
        # in the root's info), or tied to one (lm_head -> embedding): one entry per storage
        elsewhere: list[ParamHealth] = []
        for h in sorted(infos.health, key=lambda h: h.module not in infos.unhooked):
            names = {f"{h.module}.{h.param}", *infos.tied_with(h.module, h.param)}
            if _corrupt(h) and any(n.rsplit(".", 1)[0] not in hooked for n in names) and not any(
                    f"{e.module}.{e.param}" in names for e in elsewhere):
                elsewhere.append(h)
        tensors = [_tensor(h, infos) for h in elsewhere]
        if not tensors:  # overwritten during the run: a tensor of a module capture not hooks
            w = _watch_rows(trace)
            unhooked = set() if w is None else {
                n.rsplit(".", 1)[0] for m, p in zip(w["module"], w["param"])
                for n in (f"{m}.{p}", *infos.tied_with(str(m), str(p)))} - hooked
            tensors = _watched(w, infos, first.step, modules=unhooked)
        if tensors:
            return Cause("corrupted_parameters", "cause: corrupted parameters read by an "
                         f"unhooked op before {module}: "
                         + "; ".join(t["words"] for t in tensors), module, tensors)
        return Cause("unhooked_op", f"cause: an unhooked op between "
                     f"{gap.last_finite_module or 'the step start'} and {module} "  # type: ignore
                     "produced the "
                     "value; no hooked module's parameters or inputs explain it", module)
    bad = [h for h in infos.health if h.module == module and _corrupt(h)]
    if bad:
        tensors = [_tensor(h, infos) for h in bad]
        return Cause("corrupted_parameters", "cause: corrupted parameters of "
                     + "; ".join(t["words"] for t in tensors), module, tensors)
    watch = _watch_rows(trace)
    tensors = _watched(watch, infos, first.step, modules={module})
    if tensors:
        return Cause("corrupted_parameters", "cause: "
                     + "; ".join(t["words"] for t in tensors), module, tensors)
    out = np.nonzero(recs["row"] == first.record_row)[0] if first.record_row >= 0 else []
    dtype = int(recs["dtype"][out[0]]) if len(out) else -1
    small = (first.input_absmax or 0.0) < FORMAT_LIMITS["fp16"]
    if dtype == _FP16 and first.inf_count > 0 and small:
        return Cause("compute_overflow", f"cause: float16 overflow inside {module}: finite "
                     f"input (|x| <= {first.input_absmax:.4g}) and finite parameters, but "
                     f"{first.inf_count} output values passed 65,504", module,
                     format="fp16", limit=FORMAT_LIMITS["fp16"])
    st = infos.static_inputs.get(module)
    st = st if st is not None and st.applied else None
    lim = _format_limit(infos.quant.get(module, {}), st.range if st else None)
    if lim is not None:
        over = [o for o in outliers if o.module == module and o.io == schema.IO_INPUT
                and o.absmax > lim[1]]
        if over:
            chans = ", ".join(f"{o.channel} ({o.absmax:.4g})" for o in over[:4])
            return Cause("activation_outlier", f"cause: input channels {chans} exceed the "
                         f"{lim[0]} limit {lim[1]:.4g}", module,
                         channels=[o.channel for o in over], format=lim[0], limit=lim[1])
    over = [o for o in outliers if o.module == module and {"fp8-e4m3", "fp8-e5m2", "fp16"}
            & set(o.limits)]
    if over:
        fmt = next(f for f in ("fp16", "fp8-e5m2", "fp8-e4m3") if f in over[0].limits)
        chans = ", ".join(f"{o.channel} ({o.absmax:.4g})" for o in over[:4])
        return Cause("activation_outlier", f"cause: input channels {chans} exceed the {fmt} "
                     f"limit {FORMAT_LIMITS[fmt]:g}", module,
                     channels=[o.channel for o in over], format=fmt, limit=FORMAT_LIMITS[fmt])
    tensors = _watched(watch, infos, first.step, modules={module}, late=True)
    if tensors:  # seen after the failing step, unchecked between: the likeliest cause left
        return Cause("corrupted_parameters", "cause: "
                     + "; ".join(t["words"] for t in tensors), module, tensors)
    return Cause("undetermined", f"cause undetermined: {module}'s parameters are finite and "
                 "no input channel exceeds a format limit; replay its GEMM to look inside",
                 module)


def describe_nonfinite_logits(trace: Trace, steps: Table) -> NonfiniteLogits | None:
    """The first step whose logits (the root module's output) hold NaN/Inf."""
    kinds = trace.module_kinds
    roots = np.nonzero(kinds == "root")[0]
    if not len(roots) or steps.empty:
        return None
    st = steps["step"]
    cand = [int(s) for s in st[(steps["logits_nan"] > 0) | (steps["logits_inf"] > 0)]]
    if not cand:
        cand = [int(s) for s in st[steps["first_nonfinite_call"] >= 0][:1]]
    for step in cand[:2]:
        recs = trace.record_table(step)
        r = np.nonzero((recs["module_id"] == int(roots[0])) & (recs["io"] == schema.IO_OUTPUT)
                       & (recs["slot"] == 0))[0]
        if not len(r):
            continue
        rec = recs.row(int(r[0]))
        nan, inf = int(rec["nan_count"]), int(rec["inf_count"])
        if nan + inf == 0:
            continue
        rows, vocab = int(rec["rows"]), int(rec["channels"])
        srow = steps.row(int(np.nonzero(st == step)[0][0]))
        last = int(srow["logits_nan"]) + int(srow["logits_inf"])
        ids: np.ndarray = np.zeros(0, np.int64)
        cr = trace.channel_ranges(rec) if int(rec["chan_offset"]) >= 0 else None
        if cr is not None:
            lo, hi = cr
            ids = np.nonzero(~np.isfinite(np.asarray(lo, np.float64))
                             | ~np.isfinite(np.asarray(hi, np.float64)))[0]
        tok = trace.token_absmax(rec) if int(rec["tok_offset"]) >= 0 else None
        no_finite = int(np.sum(~np.isfinite(np.asarray(tok, np.float64)))) if tok is not None \
            else (rows if nan + inf == rows * vocab else -1)  # -1: not recorded
        per_row = nan + inf if rows == 1 else (
            len(ids) if len(ids) and len(ids) * rows == nan + inf else None)
        if not len(ids) and nan + inf == rows * vocab:
            ids = np.arange(vocab)  # every logit is non-finite
        nxt = None
        try:
            following = trace.input_ids(step + 1)
            if len(following):
                nxt = int(following[0])
        except Exception:  # noqa: BLE001 - no next step recorded
            nxt = None
        argmax = int(srow["logits_argmax"])
        if nxt is None:
            symptom = "no later step recorded: what decoding did with it is unknown"
        elif nxt == 0:
            symptom = ("greedy decoding then emitted vocab id 0, the first id: argmax over an "
                       "all-NaN row (the '!!!!!!' / repeated first-token output)")
        elif len(ids) and nxt in set(ids.tolist()):
            symptom = f"greedy decoding then emitted vocab id {nxt}, a NaN entry (argmax " \
                      "treats NaN as the largest value)"
        else:
            symptom = f"the next token fed back was vocab id {nxt}"
        return NonfiniteLogits(step, rows, vocab, nan, inf, per_row, last, no_finite,
                               [int(i) for i in ids[:32]], len(ids), argmax, nxt, symptom)
    return None
