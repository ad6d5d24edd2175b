"""Warning signs from the per-step logits summaries and generated tokens: growth of the logits
range before a NaN, entropy collapse, repeated-token loops, near-uniform or extreme logits, and a
recorded outcome that disagrees with the reference. In a run without NaN/Inf these are silent
failures (verdict SUSPECT); before a NaN they are its precursors. Reads /steps only.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from qforensics.analyze.findings import Precursor
from qforensics.analyze.thresholds import Thresholds
from qforensics.trace.table import Table

__all__ = ["find_precursors"]


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


def _growth(steps: Table, a: np.ndarray, th: Thresholds, silent: bool,
            fail_step: int | None) -> Precursor | None:
    if len(a) < 2:
        return None
    rises = np.isfinite(a[1:]) & np.isfinite(a[:-1]) & (a[1:] > a[:-1])
    best = None
    for s, e in _runs(rises):  # rises s..e-1: values s..e rise
        n = e - s
        if n < th.logits_growth_steps or a[s] <= 0:
            continue
        factor = a[e] / a[s]
        if factor < th.logits_growth_factor:
            continue
        key = (e == len(a) - 1, factor)
        if best is None or key > best[0]:
            best = (key, s, e, factor)
    if best is None:
        return None
    _, s, e, factor = best
    st = steps["step"]
    vals = [float(v) for v in a[s:e + 1]]
    line = (f"max |logit| rose {e - s} steps in a row, {vals[0]:.4g} -> {vals[-1]:.4g} "
            f"(x{factor:.3g}), steps {int(st[s])}-{int(st[e])}")
    if fail_step is not None:
        line += f", before the first non-finite value at step {fail_step}"
    return Precursor("logits_growth", int(st[s]), int(st[e]), float(factor), silent, line, vals)


def _entropy(steps: Table, th: Thresholds, silent: bool) -> Precursor | None:
    ent = steps["logits_entropy"].astype(np.float64)
    ok = np.isfinite(ent)
    if ok.sum() < th.logits_growth_steps + 1:
        return None
    low = ok & (ent < th.entropy_low)
    st = steps["step"]
    for s, e in _runs(low):
        if e - s < th.logits_growth_steps or s == 0:
            continue
        before = ent[:s][ok[:s]]
        base = float(np.median(before)) if len(before) else math.nan
        if not base >= 10 * max(th.entropy_low, 1e-12):
            continue
        return Precursor("entropy_collapse", int(st[s]), int(st[e - 1]), float(np.min(ent[s:e])),
                         silent, f"logits entropy collapsed from a median of {base:.3g} nats to "
                         f"below {th.entropy_low:g} for {e - s} steps (steps {int(st[s])}-"
                         f"{int(st[e - 1])})", [float(v) for v in ent[s:e]])
    return None


def _repeat(steps: Table, th: Thresholds, silent: bool) -> Precursor | None:
    ids = steps["logits_argmax"].astype(np.int64)
    st = steps["step"]
    n = len(ids)
    need = int(th.repeat_tokens)
    if n < need or need < 2:
        return None
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
            what = (f"token {cyc[0]} repeated {covered} times" if p == 1 else
                    f"the {p}-token cycle {cyc} repeated over {covered} tokens")
            return Precursor("repeat_loop", int(st[s]), int(st[s + covered - 1]), float(covered),
                             silent, f"{what} (argmax, steps {int(st[s])}-"
                             f"{int(st[s + covered - 1])})", [float(x) for x in cyc])
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
                    fail_row: int | None, vocab: int | None) -> list[Precursor]:
    """Precursors before the first bad step (`fail_row`, a /steps position) or, with no
    failure, silent failures over the whole run."""
    silent = fail_row is None
    fail_step = None if fail_row is None else int(steps["step"][fail_row])
    view = steps if fail_row is None else steps.take(slice(0, fail_row))
    a = _logit_absmax(view)
    last = int(steps["step"][-1]) if len(steps) else -1
    items = [
        _growth(view, a, th, silent, fail_step),
        _entropy(view, th, silent),
        _repeat(view, th, silent),
        _uniform(view, th, silent, vocab),
        _extreme(view, a, th, silent),
        _degenerate(view, th, silent),
        _outcome(meta, th, silent, last) if silent else None,
    ]
    return [p for p in items if p is not None]
