"""Warning signs from the per-step logits summaries and generated tokens: growth of the logits
range before a NaN, entropy collapse, repeated-token loops, near-uniform or extreme logits, and a
recorded outcome that disagrees with the reference. In a run without NaN/Inf these are silent
failures (verdict SUSPECT); before a NaN they are its precursors. Reads /steps (and, for an
engine run, which request each step's logits summary belongs to: `summary_owners`).

The shape rules (growth, entropy collapse, repeat loop) judge each request's own series of
steps, never a series that jumps between requests. A healthy model decoding greedily is often
certain (entropy below 0.01 nats for dozens of steps) and loops ("8888...", a recipe line
repeated): those are not failures. A collapse or a loop is a warning sign only when the logits'
scale departs from that request's own earlier steps at the same time (logits std, or max
|logit|, at least `collapse_scale` x its median before the symptom): a scale that broke, not a
confident model. docs/thresholds.md has the healthy distributions behind every threshold
(`python bench/healthy_stats.py` measures them).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from qforensics.analyze.findings import Precursor
from qforensics.analyze.thresholds import Thresholds
from qforensics.trace.table import Table

__all__ = ["find_precursors", "rule_statistics", "summary_owners"]


def _logit_absmax(steps: Table) -> np.ndarray:
    lo = steps["logits_min"].astype(np.float64)
    hi = steps["logits_max"].astype(np.float64)
    a = np.fmax(np.abs(lo), np.abs(hi))
    has = steps["has_logits"] > 0
    return np.where(has, a, np.nan)


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) of each run of True."""
    if not len(mask):
        return []
    d = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.nonzero(d == 1)[0].tolist(), np.nonzero(d == -1)[0].tolist()))


def summary_owners(trace: Any, steps: Table) -> np.ndarray | None:
    """For an engine trace: per /steps row, the request (index into /engine/requests) whose
    logits row the step's summary describes: the request of the step's last token row (vLLM
    computes one logits row per request, in batch order, and the summary is of the last).
    -1 where unknown; None for a trace without /engine/rows (one series, e.g. HF)."""
    try:
        if "rows" not in getattr(trace, "_engine_tables", ()):
            return None
        rows = trace.engine_columns("rows")
    except Exception:  # noqa: BLE001 - an unreadable side table: judge one series
        return None
    s = np.asarray(rows["step"], np.int64)
    if not len(s):
        return None
    order = np.argsort(s, kind="stable")
    s, req = s[order], np.asarray(rows["request"], np.int64)[order]
    last = np.r_[np.nonzero(np.diff(s))[0], len(s) - 1]
    want = np.asarray(steps["step"], np.int64)
    i = np.searchsorted(s[last], want)
    i = np.minimum(i, len(last) - 1)
    hit = s[last][i] == want
    return np.where(hit, req[last][i], -1)


def _series(n: int, owners: np.ndarray | None) -> list[np.ndarray]:
    """Row indices of each request's own series of steps (in step order); one series when the
    owners are unknown."""
    if owners is None or len(owners) != n:
        return [np.arange(n)]
    return [np.nonzero(owners == r)[0] for r in np.unique(owners)]


def _median_before(x: np.ndarray, s: int) -> float:
    before = x[:s][np.isfinite(x[:s])]
    return float(np.median(before)) if len(before) else math.nan


def _growth_runs(a: np.ndarray, min_steps: int) -> list[tuple[int, int, float]]:
    """(s, e, factor) of every run of at least `min_steps` consecutive rises (values s..e)."""
    if len(a) < 2:
        return []
    rises = np.isfinite(a[1:]) & np.isfinite(a[:-1]) & (a[1:] > a[:-1])
    return [(s, e, float(a[e] / a[s])) for s, e in _runs(rises)
            if e - s >= min_steps and a[s] > 0]


def _growth(steps: Table, a: np.ndarray, th: Thresholds, silent: bool,
            fail_step: int | None, owners: np.ndarray | None = None) -> Precursor | None:
    best = None
    for idx in _series(len(a), owners):
        for s, e, factor in _growth_runs(a[idx], int(th.logits_growth_steps)):
            if factor < th.logits_growth_factor:
                continue
            key = (idx[e] == len(a) - 1, factor)
            if best is None or key > best[0]:
                best = (key, idx[s:e + 1], factor)
    if best is None:
        return None
    _, span, factor = best
    s, e = int(span[0]), int(span[-1])
    st = steps["step"]
    vals = [float(v) for v in a[span]]
    line = (f"max |logit| rose {len(span) - 1} steps in a row, {vals[0]:.4g} -> {vals[-1]:.4g} "
            f"(x{factor:.3g}), steps {int(st[s])}-{int(st[e])}")
    if fail_step is not None:
        line += f", before the first non-finite value at step {fail_step}"
    return Precursor("logits_growth", int(st[s]), int(st[e]), float(factor), silent, line, vals)


def _collapses(ent: np.ndarray, std: np.ndarray, th: Thresholds
               ) -> list[tuple[int, int, float, float]]:
    """(s, e, base entropy, std ratio) of each run of at least `logits_growth_steps` steps of
    one series below `entropy_low`, after earlier steps whose median entropy is ten times
    higher; the std ratio is the run's median logits std over the median before it."""
    ok = np.isfinite(ent)
    out = []
    for s, e in _runs(ok & (ent < th.entropy_low)):
        if e - s < th.logits_growth_steps or s == 0:
            continue
        base = _median_before(ent, s)
        if not base >= 10 * max(th.entropy_low, 1e-12):
            continue
        ref = _median_before(std, s)
        run = std[s:e][np.isfinite(std[s:e])]
        ratio = float(np.median(run) / ref) if len(run) and ref > 0 else math.nan
        out.append((s, e, base, ratio))
    return out


def _entropy(steps: Table, th: Thresholds, silent: bool,
             owners: np.ndarray | None = None) -> Precursor | None:
    ent_all = steps["logits_entropy"].astype(np.float64)
    std_all = steps["logits_std"].astype(np.float64)
    st = steps["step"]
    for idx in _series(len(ent_all), owners):
        ent, std = ent_all[idx], std_all[idx]
        if np.isfinite(ent).sum() < th.logits_growth_steps + 1:
            continue
        for s, e, base, ratio in _collapses(ent, std, th):
            if not ratio >= th.collapse_scale:
                continue  # a confident model, not a broken scale (docs/thresholds.md)
            a, b = int(st[idx[s]]), int(st[idx[e - 1]])
            return Precursor("entropy_collapse", a, b, float(np.min(ent[s:e])), silent,
                             f"logits entropy collapsed from a median of {base:.3g} nats to "
                             f"below {th.entropy_low:g} for {e - s} steps (steps {a}-{b}) while "
                             f"the logits' std rose to x{ratio:.3g} of its median before",
                             [float(v) for v in ent[s:e]])
    return None


def _loops(ids: np.ndarray, need: int) -> list[tuple[int, int, list[int]]]:
    """(s, covered, cycle) of each argmax loop of a cycle of at most 4 tokens covering at least
    `need` tokens of one series."""
    out = []
    n = len(ids)
    if n < need or need < 2:
        return out
    for p in (1, 2, 3, 4):
        if p >= need:
            break
        same = (ids[p:] == ids[:-p]) & (ids[p:] >= 0)
        for s, e in _runs(same):
            covered = e - s + p  # tokens s .. e+p-1 follow the cycle
            if covered < need:
                continue
            cyc = ids[s:s + p].tolist()
            if p > 1 and len(set(cyc)) == 1:
                continue  # a run of one token, reported with p = 1
            out.append((s, covered, cyc))
    return out


def _loop_scale(a: np.ndarray, s: int, covered: int) -> float:
    """Median max |logit| over a loop against the series' median before it; a loop from the
    series' first step has nothing to compare with (NaN)."""
    ref = _median_before(a, s)
    run = a[s:s + covered][np.isfinite(a[s:s + covered])]
    return float(np.median(run) / ref) if len(run) and ref > 0 else math.nan


def _repeat(steps: Table, a_all: np.ndarray, th: Thresholds, silent: bool,
            owners: np.ndarray | None = None) -> Precursor | None:
    ids_all = steps["logits_argmax"].astype(np.int64)
    st = steps["step"]
    for idx in _series(len(ids_all), owners):
        ids, a = ids_all[idx], a_all[idx]
        for s, covered, cyc in _loops(ids, int(th.repeat_tokens)):
            ratio = _loop_scale(a, s, covered)
            if not ratio >= th.collapse_scale:
                continue  # healthy greedy decoding loops too (docs/thresholds.md)
            p = len(cyc)
            a0, b0 = int(st[idx[s]]), int(st[idx[s + covered - 1]])
            what = (f"token {cyc[0]} repeated {covered} times" if p == 1 else
                    f"the {p}-token cycle {cyc} repeated over {covered} tokens")
            return Precursor("repeat_loop", a0, b0, float(covered), silent,
                             f"{what} (argmax, steps {a0}-{b0}) while max |logit| rose to "
                             f"x{ratio:.3g} of its median before", [float(x) for x in cyc])
    return None


def _uniform(steps: Table, th: Thresholds, silent: bool, vocab: int | None
             ) -> Precursor | None:
    if not vocab or vocab < 2:
        return None
    ent = steps["logits_entropy"].astype(np.float64)
    lim = th.entropy_uniform * math.log(vocab)
    hot = np.isfinite(ent) & (ent >= lim)
    if not hot.any():
        return None
    st = steps["step"]
    i = np.nonzero(hot)[0]
    return Precursor("uniform_logits", int(st[i[0]]), int(st[i[-1]]), float(ent[i].max()), silent,
                     f"near-uniform logits in {len(i)} of {len(ent)} steps: entropy up to "
                     f"{float(ent[i].max()):.4g} nats of at most {math.log(vocab):.4g} "
                     f"(vocabulary {vocab:,})", [float(v) for v in ent[i][:64]])


def _extreme(steps: Table, a: np.ndarray, th: Thresholds, silent: bool
             ) -> Precursor | None:
    hot = np.isfinite(a) & (a >= th.logits_extreme)
    if not hot.any():
        return None
    st = steps["step"]
    i = np.nonzero(hot)[0]
    return Precursor("extreme_logits", int(st[i[0]]), int(st[i[-1]]), float(a[i].max()), silent,
                     f"max |logit| reaches {float(a[i].max()):.4g} (>= {th.logits_extreme:g}) "
                     f"in {len(i)} steps, first at step {int(st[i[0]])}",
                     [float(v) for v in a[i][:64]])


def _degenerate(steps: Table, th: Thresholds, silent: bool) -> Precursor | None:
    """Greedy decoding stuck on vocab id 0 (a special token; "!!!!!!" in some vocabularies)."""
    ids = steps["logits_argmax"].astype(np.int64)
    hot = ids == 0
    if int(hot.sum()) < max(1, int(th.degenerate_steps)):
        return None
    st = steps["step"]
    i = np.nonzero(hot)[0]
    return Precursor("degenerate_ids", int(st[i[0]]), int(st[i[-1]]), float(len(i)), silent,
                     f"the argmax is vocab id 0 in {len(i)} of {len(ids)} steps (first at step "
                     f"{int(st[i[0]])}): degenerate output")


def _outcome(meta: dict[str, Any], th: Thresholds, silent: bool, last_step: int
             ) -> Precursor | None:
    oc = meta.get("outcome")
    if not isinstance(oc, dict):
        return None
    agree = oc.get("top1_agreement")
    if isinstance(agree, (int, float)) and not isinstance(agree, bool) and math.isfinite(agree) \
            and agree < th.agreement_min:
        return Precursor("outcome", 0, last_step, float(agree), silent,
                         f"only {100 * agree:.1f}% of top-1 tokens agree with the reference "
                         "(outcome metadata, teacher-forced)")
    for key in ("ok", "passed", "healthy", "correct", "success"):
        if oc.get(key) is False:
            return Precursor("outcome", 0, last_step, 0.0, silent,
                             f"the recorded outcome says {key}=false")
    return None


def find_precursors(steps: Table, meta: dict[str, Any], th: Thresholds, *,
                    fail_row: int | None, vocab: int | None,
                    owners: np.ndarray | None = None) -> list[Precursor]:
    """Precursors before the first bad step (`fail_row`, a /steps position) or, with no
    failure, silent failures over the whole run. `owners`: per /steps row, the request its
    logits summary belongs to (`summary_owners`), or None for one series."""
    silent = fail_row is None
    fail_step = None if fail_row is None else int(steps["step"][fail_row])
    view = steps if fail_row is None else steps.take(slice(0, fail_row))
    own = None if owners is None else np.asarray(owners)[:len(view)]
    a = _logit_absmax(view)
    last = int(steps["step"][-1]) if len(steps) else -1
    items = [
        _growth(view, a, th, silent, fail_step, own),
        _entropy(view, th, silent, own),
        _repeat(view, a, th, silent, own),
        _uniform(view, th, silent, vocab),
        _extreme(view, a, th, silent),
        _degenerate(view, th, silent),
        _outcome(meta, th, silent, last) if silent else None,
    ]
    return [p for p in items if p is not None]


def rule_statistics(steps: Table, vocab: int | None, th: Thresholds,
                    owners: np.ndarray | None = None) -> dict[str, float]:
    """The statistic each silent rule holds against its threshold, at its worst over the run
    (max over requests): what bench/healthy_stats.py prints for healthy runs.

    growth_factor: the largest rise of max |logit| over >= logits_growth_steps rising steps;
    collapse_steps / collapse_scale: the longest run of >= logits_growth_steps steps of a
    request below entropy_low (whatever came before) and the largest std ratio of any;
    repeat_tokens / repeat_scale: the longest argmax loop and the largest max |logit| ratio of
    any loop; uniform_share: the largest entropy / log(vocab); extreme_logit: the largest
    max |logit|; degenerate_steps: steps whose argmax is vocab id 0."""
    a = _logit_absmax(steps)
    ent_all = steps["logits_entropy"].astype(np.float64)
    std_all = steps["logits_std"].astype(np.float64)
    ids_all = steps["logits_argmax"].astype(np.int64)
    out = {"growth_factor": 1.0, "collapse_steps": 0.0, "collapse_scale": 0.0,
           "repeat_tokens": 0.0, "repeat_scale": 0.0}
    for idx in _series(len(a), owners):
        for _, _, f in _growth_runs(a[idx], int(th.logits_growth_steps)):
            out["growth_factor"] = max(out["growth_factor"], f)
        ent, std = ent_all[idx], std_all[idx]
        for s, e in _runs(np.isfinite(ent) & (ent < th.entropy_low)):
            if e - s < th.logits_growth_steps:
                continue  # every confident stretch, whatever the median before it
            out["collapse_steps"] = max(out["collapse_steps"], float(e - s))
            ref = _median_before(std, s)
            if ref > 0:
                out["collapse_scale"] = max(out["collapse_scale"],
                                            float(np.nanmedian(std[s:e]) / ref))
        for s, covered, _ in _loops(ids_all[idx], int(th.repeat_tokens)):
            out["repeat_tokens"] = max(out["repeat_tokens"], float(covered))
            r = _loop_scale(a[idx], s, covered)
            if math.isfinite(r):
                out["repeat_scale"] = max(out["repeat_scale"], r)
    fin = np.isfinite(ent_all)
    out["uniform_share"] = (float(ent_all[fin].max() / math.log(vocab))
                            if vocab and vocab > 1 and fin.any() else math.nan)
    out["extreme_logit"] = float(np.nanmax(a)) if np.isfinite(a).any() else math.nan
    out["degenerate_steps"] = float((ids_all == 0).sum())
    return out
