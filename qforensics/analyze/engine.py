"""Serving-engine meaning of a trace (vLLM): warm-up steps, which requests the non-finite rows
of a step belong to, and, for every request that went bad over the whole run, whether it was
possibly reached from another or went bad on its own (analyze/badrequests.py).

Reads only the /engine tables, the root module's row-flag records (schema.ENGINE_ROW_FLAG_SLOTS)
and the records of the steps where a request first went bad. A trace without them (an HF run)
gives no engine findings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from qforensics.analyze.badrequests import (
    BadRequest,
    RequestHit,
    SameSpot,
    StepRows,
    classify,
    scan_hits,
)
from qforensics.trace import schema
from qforensics.trace.badstep import bad_steps
from qforensics.trace.reader import Trace
from qforensics.trace.table import Table

__all__ = ["EngineFindings", "RequestHit", "engine_info", "find_engine_findings",
           "hf_aligned_records", "warmup_steps", "without_warmup"]

if TYPE_CHECKING:
    import pandas as pd


@dataclass
class EngineFindings:
    engine: str
    version: str
    n_requests: int
    warmup_steps: list[int]
    first_bad_step: int | None = None
    # the rows of the first non-finite output (from its snapshot): request -> positions there
    origin: dict[str, list[int]] = field(default_factory=dict)
    origin_module: str = ""
    # the quantization scales of the producing layer, as the engine held them (engine metadata)
    producer_scales: dict[str, Any] = field(default_factory=dict)
    producer: str = ""
    first: list[RequestHit] = field(default_factory=list)  # requests hit at the first bad step
    # others that went bad at a later step while a bad request held NaN/Inf in that forward
    reached: list[RequestHit] = field(default_factory=list)
    clean: list[str] = field(default_factory=list)  # requests never hit in the steps read
    followed_steps: int = 0  # steps whose row flags were read (every one the trace holds)
    went_bad: list[BadRequest] = field(default_factory=list)  # every request, first bad first
    same_spots: list[SameSpot] = field(default_factory=list)  # >= 2 on their own at one spot
    # non-finite steps (by the summaries) whose token rows the trace no longer holds
    unattributed_steps: int = 0

    def lines(self) -> list[str]:
        out = []
        if self.warmup_steps:
            out.append(f"{len(self.warmup_steps)} warm-up/profile forward(s) of {self.engine} "
                       f"(steps {_steps(self.warmup_steps)}) recorded and left out of the verdict")
        if self.first_bad_step is None and not self.went_bad and not self.unattributed_steps:
            return out
        if self.first_bad_step is not None and not self.first:
            out.append(f"step {self.first_bad_step}: no per-row flags recorded; the requests "
                       "of the non-finite rows are unknown")
        if self.origin:
            out.append(f"the first non-finite output ({self.origin_module}) has its NaN/Inf in "
                       + "; ".join(f"request {r} at positions {p[:8]}"
                                   for r, p in self.origin.items()))
        for name, d in self.producer_scales.items():
            bad = int(d.get("nan", 0)) + int(d.get("inf", 0))
            if bad:
                out.append(f"{self.engine} holds {self.producer}.{name} {d.get('shape')} with "
                           f"{d.get('nan', 0)} NaN and {d.get('inf', 0)} Inf, the first at index "
                           f"{d.get('first_nonfinite_index')}")
        if self.first:
            who = "; ".join(_hit(h) for h in self.first)
            out.append(f"step {self.first_bad_step}: non-finite rows belong to {who}")
        out.extend(self._bad_lines())
        if self.clean and self.went_bad:
            # "never" only when every non-finite step's rows were read
            out.append(("requests never hit" if not self.unattributed_steps else
                        "requests not seen hit") + f": {', '.join(self.clean[:8])}"
                       + (f" (+{len(self.clean) - 8} more)" if len(self.clean) > 8 else ""))
        return out

    def _bad_lines(self) -> list[str]:
        out = []
        if self.reached:
            by = {b.request_id: b for b in self.went_bad}
            out.append("possibly spread to other requests: " + "; ".join(
                f"{h.request_id} at step {h.step}"
                + (f" (from {', '.join(by[h.request_id].spread_from[:4])} in the same forward)"
                   if h.request_id in by and by[h.request_id].spread_from else "")
                for h in self.reached))
        if len(self.went_bad) > 1:
            alone = sum(b.kind.startswith("independent") for b in self.went_bad)
            spread = sum(b.kind == "possibly_spread" for b in self.went_bad)
            kv = sum(b.kind == "possibly_via_kv_cache" for b in self.went_bad)
            rest = len(self.went_bad) - alone - spread - kv
            out.append(f"{len(self.went_bad)} requests went bad over the run: {alone} on "
                       f"their own, {spread} possibly spread"
                       + (f", {kv} possibly through the KV cache" if kv else "")
                       + (f", {rest} undetermined" if rest else ""))
            out.extend(b.line for b in self.went_bad[:8])
            if len(self.went_bad) > 8:
                out.append(f"... {len(self.went_bad) - 8} more (--json lists all)")
        elif self.followed_steps > 1:
            out.append(f"no other request went bad in the {self.followed_steps} steps read")
        out.extend(sp.line for sp in self.same_spots)
        if self.unattributed_steps:
            out.append(f"{self.unattributed_steps} non-finite step(s) have no recorded token "
                       "rows: the requests they hit are unknown")
        return out


def _steps(s: list[int]) -> str:
    return ", ".join(str(x) for x in s[:8]) + (f" ... ({len(s)})" if len(s) > 8 else "")


def _hit(h: RequestHit) -> str:
    where = f"{h.rows} token row(s), {h.phase}, positions {h.positions}" if h.rows else \
        "its logits row only"
    return f"request {h.request_id} ({where})"


def engine_info(meta: dict[str, Any]) -> dict[str, Any] | None:
    env = meta.get("environment")
    eng = env.get("engine") if isinstance(env, dict) else None
    return eng if isinstance(eng, dict) else None


def warmup_steps(trace: Trace) -> np.ndarray:
    es = trace.engine_columns("steps")
    if es.empty:
        return np.zeros(0, np.int64)
    return np.unique(es["step"][es["warmup"] != 0].astype(np.int64))


_CLEARED = (("n_nonfinite_records", 0), ("first_nonfinite_record", -1),
            ("first_nonfinite_call", -1), ("logits_nan", 0), ("logits_inf", 0))


def without_warmup(steps: Table, warm: np.ndarray) -> Table:
    """The step table with warm-up steps' non-finite summaries cleared, so that nothing a
    warm-up forward did drives a verdict (rows stay in place: positions keep their meaning)."""
    if not len(warm):
        return steps
    m = np.isin(steps["step"], warm)
    cleared = {}
    for col, value in _CLEARED:
        a = steps[col].copy()
        a[m] = value
        cleared[col] = a
    return steps.with_columns(**cleared)


def find_engine_findings(trace: Trace, first_bad_step: int | None,
                         producer: str | None = None, *, steps: Table | None = None,
                         nonfinite_steps: int | None = None) -> EngineFindings | None:
    """`steps`: the step table with warm-ups cleared (`without_warmup`); `nonfinite_steps`:
    the non-finite steps the summaries count (to say how many lack their token rows)."""
    info = engine_info(trace.meta)
    if info is None:
        return None
    reqs = trace.engine_columns("requests")
    req_ids = {int(r): str(i) for r, i in zip(reqs["request"], reqs["request_id"])}
    warm = warmup_steps(trace)
    ef = EngineFindings(engine=str(info.get("name", "engine")),
                        version=str(info.get("version", "unknown")), n_requests=len(reqs),
                        warmup_steps=[int(s) for s in warm],
                        first_bad_step=first_bad_step)
    if producer:
        health = info.get("scale_health")
        h = health.get(producer) if isinstance(health, dict) else None
        if isinstance(h, dict):
            ef.producer = producer
            ef.producer_scales = {k: v for k, v in h.items() if isinstance(v, dict)}
    rows = trace.engine_columns("rows")
    sr = StepRows(rows)
    kinds = trace.module_kinds.tolist()
    root_id = kinds.index("root") if "root" in kinds else len(kinds) - 1
    run = scan_hits(trace, sr, req_ids, root_id, warm)
    ef.followed_steps = run.steps_read
    hits = trace.engine_columns("hits")
    ef.went_bad, ef.same_spots = classify(trace, run, sr, reqs, hits)
    if first_bad_step is not None:
        ef.first = run.hits.get(first_bad_step, [])
    by = {b.request_id: b for b in ef.went_bad}
    ef.reached = [run.hits[b.step][[h.request_id for h in run.hits[b.step]].index(b.request_id)]
                  for b in ef.went_bad if b.kind == "possibly_spread" and b.step in run.hits
                  and b.request_id in [h.request_id for h in run.hits[b.step]]
                  and (first_bad_step is None or b.step > first_bad_step)]
    if nonfinite_steps is not None and steps is not None:
        st = steps
        bad = bad_steps(st, warmup=warm)
        known = set(int(x) for x in st["step"][bad]) | set(run.hits)
        known = {x for x in known if len(sr.at(x))}
        # a step where the writer found a request's first NaN/Inf (/engine/hits) is known too
        known |= {int(x) for x in hits["step"]}
        # a step the writer scanned is read too (every request bad there has its row or was bad
        # before), unless it dropped rows for want of room
        hc = trace.hits_checked
        scanned = hc["scanned"] if hc and not hc["dropped"] else 0
        ef.unattributed_steps = max(0, int(nonfinite_steps) - max(len(known), scanned))
    if first_bad_step is not None:
        _origin(trace, ef, rows, req_ids)
    ef.clean = [rid for rid in req_ids.values() if rid not in by]
    return ef


def _origin(trace: Trace, ef: EngineFindings, rows: Table, req_ids: dict[int, str]
            ) -> None:
    """Requests and positions of the token rows where the first non-finite output has its
    NaN/Inf (the capture keeps up to 256 positions with that call's snapshot)."""
    snaps = trace.snapshot_table
    sel = np.nonzero((snaps["reason"] == "first_nonfinite_output")
                     & (snaps["step"] == ef.first_bad_step))[0]
    if not len(sel):
        return
    ci = int(snaps["call_index"][sel[0]])
    try:
        tensors = trace.snapshot_tensors(ci)
    except Exception:
        return
    pos, out = tensors.get("nonfinite_positions"), tensors.get("output.0")
    if pos is None or out is None or pos.ndim != 2 or pos.shape[1] != out.ndim or out.ndim < 2:
        return
    token_rows = np.unique(np.ravel_multi_index(tuple(pos[:, :-1].T.astype(np.int64)),
                                                out.shape[:-1]))
    at = np.nonzero(rows["step"] == ef.first_bad_step)[0]
    where: dict[int, int] = {}
    for i in at:
        where.setdefault(int(rows["row"][i]), int(i))
    by: dict[str, list[int]] = {}
    for r in token_rows:
        i = where.get(int(r))
        if i is not None:
            by.setdefault(req_ids.get(int(rows["request"][i]), "?"), []).append(
                int(rows["position"][i]))
    ef.origin = by
    ef.origin_module = str(snaps["module"][sel[0]])


def hf_aligned_records(trace: Trace, recs: pd.DataFrame) -> pd.DataFrame:
    """An engine trace's records renamed to the HF module names, for `diff` against an HF
    trace: a fused layer's input record stands for each HF layer it holds (q/k/v and gate/up
    read the same input); its output (the shards side by side) has no HF counterpart and is
    left under its own name, as are the row-flag records. Other traces pass unchanged."""
    info = engine_info(trace.meta)
    hf = info.get("hf_names") if info else None
    if not isinstance(hf, dict) or recs.empty or "module" not in recs:
        return recs
    import pandas as pd

    kinds = trace.module_kinds.tolist()
    root_id = kinds.index("root") if "root" in kinds else -1
    recs = recs[~((recs["module_id"] == root_id) & (recs["slot"] > 0))]
    fused = recs["module"].isin(list(hf)) & (recs["io"] == schema.IO_INPUT)
    if not fused.any():
        return recs
    parts = [recs[~fused]]
    for name, g in recs[fused].groupby("module", sort=False):
        for hf_name in hf[name]:
            parts.append(g.assign(module=str(hf_name)))
    return pd.concat(parts).sort_values(["call_index", "io", "slot"], kind="stable")
