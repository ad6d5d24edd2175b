"""`diff_traces(reference, suspect) -> DiffFindings`: the same prompt captured twice (e.g. FP16 vs
INT4), records aligned by (module, step, io, slot, occurrence), divergence of the recorded
statistics and per-channel ranges (and of snapshot tensors both traces kept), the first module in
call order where divergence jumps, and a ranked list (decoder blocks are left out of both: they
aggregate what their children add). The alignment uses pandas, imported when a diff runs (an
analysis without a reference never loads it).

Score of a record: max(relative error of std, per-channel range divergence) - or of absmax when
either side lacks channel ranges. Channel divergence: sum|dmin| + sum|dmax| over
sum|min_ref| + sum|max_ref|. Jump of a call: its output's score minus its input's score (what
the module itself added); for a call without a recorded input, minus the previous output's.
No torch import.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

import numpy as np

from qforensics.analyze.engine import hf_aligned_records
from qforensics.analyze.findings import (
    FAILED,
    PASSED,
    SUSPECT,
    DiffFindings,
    Divergence,
    Verdict,
)
from qforensics.errors import QForensicsError, UsageError
from qforensics.formats import KIND_BLOCK
from qforensics.trace import schema
from qforensics.trace.reader import Trace, open_trace

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["DEFAULT_JUMP", "diff_traces"]

DEFAULT_JUMP = 0.3
_EPS = 1e-12
_KEY = ["module", "step", "io", "slot", "occ"]


def _steps_to_compare(ref: Trace, sus: Trace, max_steps: int) -> tuple[list[int], list[str]]:
    notes = []
    common = [s for s in ref.iter_steps() if s in set(sus.iter_steps())]
    if not common:
        return [], ["the traces have no step in common"]
    out = []
    for s in common:
        a, b = ref.input_ids(s), sus.input_ids(s)
        if len(a) and len(b) and not np.array_equal(a, b):
            notes.append(f"input tokens differ from step {s} on (the suspect generated "
                         "different tokens): later steps are not compared")
            break
        out.append(s)
        if len(out) >= max_steps:
            break
    if not out:
        out = [common[0]]
    return out, notes


def _with_occ(df: pd.DataFrame) -> pd.DataFrame:
    df = df.copy()
    df["occ"] = df.groupby(["module", "io", "slot"]).cumcount()
    return df


def _rel(a: np.ndarray, b: np.ndarray, denom: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        r = np.abs(b - a) / np.maximum(np.abs(denom), _EPS)
    return np.where(np.isfinite(r), r, np.where(np.isnan(a) & np.isnan(b), 0.0, np.inf))


def _side(m: pd.DataFrame, sfx: str) -> pd.DataFrame:
    """One trace's record columns of the aligned frame, as `Trace.channel_block` takes them."""
    import pandas as pd

    return pd.DataFrame({k: m[k + sfx].to_numpy() for k in ("row", "chan_offset", "channels")})


def _channel_div(ref: Trace, sus: Trace, m: pd.DataFrame) -> np.ndarray:
    out = np.full(len(m), np.nan)
    br, bs = ref.channel_block(_side(m, "_r"), tokens=False), \
        sus.channel_block(_side(m, "_s"), tokens=False)
    for i, (rr, rs) in enumerate(zip(m["row_r"], m["row_s"])):
        a, b = br.channels(rr), bs.channels(rs)
        if a is None or b is None or len(a[0]) != len(b[0]) or not len(a[0]):
            continue
        rmin, rmax = a[0].astype(np.float64), a[1].astype(np.float64)
        smin, smax = b
        d = np.nansum(np.abs(smin - rmin)) + np.nansum(np.abs(smax - rmax))
        n = np.nansum(np.abs(rmin)) + np.nansum(np.abs(rmax))
        out[i] = d / max(n, _EPS)
    return out


def _snapshot_metrics(ref: Trace, sus: Trace, m: pd.DataFrame) -> dict[int, tuple[float, float]]:
    """aligned-row index -> (sqnr_db, cosine) where both traces kept the same tensor."""
    out: dict[int, tuple[float, float]] = {}
    sr, ss = ref.snapshots, sus.snapshots
    if not len(sr) or not len(ss):
        return out
    rcalls = set(sr["call_index"].tolist())
    scalls = set(ss["call_index"].tolist())
    for i, (cr, cs, io, slot) in enumerate(zip(m["call_index_r"], m["call_index_s"], m["io"],
                                              m["slot"])):
        if cr not in rcalls or cs not in scalls:
            continue
        name = f"{'input' if io == schema.IO_INPUT else 'output'}.{slot}"
        try:
            a = ref.snapshot_tensors(int(cr)).get(name)
            b = sus.snapshot_tensors(int(cs)).get(name)
        except QForensicsError:  # a malformed snapshot: compare the statistics only
            continue
        if a is None or b is None or a.shape != b.shape or not a.size:
            continue
        a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
        ok = np.isfinite(a64) & np.isfinite(b64)
        if not ok.any():
            continue
        a64, b64 = a64[ok], b64[ok]
        noise = float(((b64 - a64) ** 2).sum())
        sig = float((a64 ** 2).sum())
        sqnr = math.inf if noise == 0 else 10 * math.log10(max(sig, _EPS) / noise)
        cos = float(a64 @ b64 / max(np.linalg.norm(a64) * np.linalg.norm(b64), _EPS))
        out[i] = (sqnr, cos)
    return out


def diff_traces(reference: str | os.PathLike[str], suspect: str | os.PathLike[str], *,
                jump: float = DEFAULT_JUMP, top: int = 10, steps: list[int] | None = None,
                max_steps: int = 1) -> DiffFindings:
    """Compare two traces of the same prompt. `jump`: the score a module must add (output score
    minus input score) to count as where divergence jumps. `steps`: steps to compare (default:
    the leading steps whose input tokens agree, at most `max_steps`, by default the prefill)."""
    import pandas as pd

    if jump < 0 or top < 1:
        raise UsageError("jump must be >= 0 and top >= 1")
    with open_trace(reference) as ref, open_trace(suspect) as sus:
        notes: list[str] = []
        damaged: list[str] = []  # what could not be read: never PASSED
        if steps is None:
            steps, notes = _steps_to_compare(ref, sus, max_steps)
        kind_of = dict(zip(ref.modules["name"], ref.modules["kind"]))
        parts = []
        n_r = n_s = 0
        for s in steps:
            try:
                a = _with_occ(hf_aligned_records(ref, ref.records(s)))
                b = _with_occ(hf_aligned_records(sus, sus.records(s)))
                m = a.merge(b, on=_KEY, suffixes=("_r", "_s"), sort=False)
                if len(m):
                    m["channel_div"] = _channel_div(ref, sus, m)
                    snap = _snapshot_metrics(ref, sus, m)
                    m["sqnr"] = [snap.get(i, (np.nan, np.nan))[0] for i in range(len(m))]
                    m["cos"] = [snap.get(i, (np.nan, np.nan))[1] for i in range(len(m))]
            except QForensicsError as exc:
                notes.append(f"step {s} skipped: {exc}")
                damaged.append(f"step {s}: {exc}")
                continue
            n_r += len(a)
            n_s += len(b)
            if len(m):
                parts.append(m)
        damaged += [f"reference: {x}" for x in ref.unreadable]
        damaged += [f"suspect: {x}" for x in sus.unreadable]
    if not parts:
        return DiffFindings(str(reference), str(suspect), Verdict(
            SUSPECT, f"{SUSPECT} | nothing to compare: no record aligns between the traces"),
            0, n_r, n_s, list(steps), None, [], {"jump": jump, "top": top}, notes)
    m = pd.concat(parts, ignore_index=True).sort_values(["call_index_r", "io", "slot"],
                                                        kind="stable").reset_index(drop=True)
    g = lambda c: m[c].to_numpy(np.float64)
    rel_abs = _rel(g("absmax_r"), g("absmax_s"), g("absmax_r"))
    rel_std = _rel(g("std_r"), g("std_s"), g("std_r"))
    rel_mean = _rel(g("mean_r"), g("mean_s"), g("std_r"))
    cdiv = g("channel_div")
    nonfin = ((m["nan_count_s"] + m["inf_count_s"]).to_numpy() > 0) & (
        (m["nan_count_r"] + m["inf_count_r"]).to_numpy() == 0)
    score = np.fmax(rel_std, np.where(np.isfinite(cdiv), cdiv, rel_abs))
    score = np.where(nonfin, np.inf, score)
    jumps = np.zeros(len(m))
    calls = m["call_index_r"].to_numpy()
    io = m["io"].to_numpy()
    slot = m["slot"].to_numpy()
    in_score: dict[int, float] = {}
    for i in np.nonzero((io == schema.IO_INPUT) & (slot == 0))[0]:
        in_score.setdefault(int(calls[i]), float(score[i]))
    prev_out = 0.0
    for i in range(len(m)):
        if io[i] != schema.IO_OUTPUT:
            continue
        base = in_score.get(int(calls[i]), prev_out)
        sc = float(score[i])
        jumps[i] = (math.inf if sc == math.inf and base != math.inf else
                    (0.0 if sc == base else sc - base))
        if slot[i] == 0:
            prev_out = sc
    divs = [Divergence(
        module=str(m["module"].iloc[i]) or "(model output)", step=int(m["step"].iloc[i]),
        io=int(io[i]), slot=int(slot[i]), call_index=int(calls[i]),
        suspect_call_index=int(m["call_index_s"].iloc[i]), rel_absmax=float(rel_abs[i]),
        rel_std=float(rel_std[i]), rel_mean=float(rel_mean[i]),
        channel_div=None if not np.isfinite(cdiv[i]) else float(cdiv[i]),
        sqnr_db=None if np.isnan(m["sqnr"].iloc[i]) else float(m["sqnr"].iloc[i]),
        cosine=None if not np.isfinite(m["cos"].iloc[i]) else float(m["cos"].iloc[i]),
        score=float(score[i]), jump=float(jumps[i]), nonfinite=bool(nonfin[i]))
        for i in range(len(m))]
    # blocks aggregate what their children add: rank the modules themselves
    outs = [d for d in divs if d.io == schema.IO_OUTPUT
            and kind_of.get("" if d.module == "(model output)" else d.module) != KIND_BLOCK]
    ranked = sorted(outs, key=lambda d: -d.jump)[:top]
    first_bad = next((d for d in divs if d.nonfinite), None)
    first_jump = next((d for d in outs if d.jump >= jump), None)
    if first_bad is not None:
        verdict = Verdict(FAILED, f"{FAILED} | the suspect first holds NaN/Inf where the reference "
                          f"is finite at step {first_bad.step}, call {first_bad.call_index}: "
                          f"{first_bad.module} ({'input' if first_bad.io == 0 else 'output'})")
    elif first_jump is not None:
        d = first_jump
        verdict = Verdict(SUSPECT, f"{SUSPECT} | divergence jumps first at step {d.step}, call "
                          f"{d.call_index}: {d.module} (score {d.score - d.jump:.3g} -> "
                          f"{d.score:.3g})")
    elif damaged:
        verdict = Verdict(SUSPECT, f"{SUSPECT} | no module adds divergence >= {jump:g} in the "
                          f"{len(m):,} records that could be read, but a trace is damaged: "
                          f"{damaged[0]}" + (f" (+{len(damaged) - 1} more)" if len(damaged) > 1
                                             else ""))
    else:
        verdict = Verdict(PASSED, f"{PASSED} | no module adds divergence >= {jump:g} in "
                          f"{len(m):,} aligned records (steps {', '.join(map(str, steps))})")
    return DiffFindings(
        reference=str(reference), suspect=str(suspect), verdict=verdict, n_aligned=len(m),
        n_only_reference=n_r - len(m), n_only_suspect=n_s - len(m), steps_compared=list(steps),
        first_jump=first_jump, ranked=ranked, thresholds={"jump": jump, "top": top},
        notes=notes + [f"could not read: {x}" for x in damaged])
