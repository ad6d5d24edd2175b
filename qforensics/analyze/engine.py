"""Serving-engine meaning of a trace (vLLM): warm-up steps, and which requests the non-finite
rows of a step belong to, and whether one request's NaN reached the others.

Reads only the /engine tables and, for the steps it looks at, the root module's row-flag records
(schema.ENGINE_ROW_FLAG_SLOTS). A trace without them (an HF run) gives no engine findings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from qforensics.trace import schema
from qforensics.trace.reader import Trace
from qforensics.trace.table import Table

if TYPE_CHECKING:
    import pandas as pd

MAX_FOLLOW_STEPS = 64  # steps after the first bad one that are read to follow the spread


@dataclass
class RequestHit:
    """One request whose rows hold NaN/Inf at one step."""

    request_id: str
    step: int
    rows: int  # its non-finite token rows in that step (0 when only its logits row is bad)
    positions: list[int]  # their positions in the request (at most 8)
    phase: str  # prefill | decode | mixed | unknown
    logits: bool  # its row of the logits is non-finite


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
    reached: list[RequestHit] = field(default_factory=list)  # others hit at a later step
    clean: list[str] = field(default_factory=list)  # requests never hit in the steps read
    followed_steps: int = 0

    def lines(self) -> list[str]:
        out = []
        if self.warmup_steps:
            out.append(f"{len(self.warmup_steps)} warm-up/profile forward(s) of {self.engine} "
                       f"(steps {_steps(self.warmup_steps)}) recorded and left out of the verdict")
        if self.first_bad_step is None:
            return out
        if not self.first:
            out.append(f"step {self.first_bad_step}: no per-row flags recorded; the requests "
                       "of the non-finite rows are unknown")
            return out
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
        who = "; ".join(_hit(h) for h in self.first)
        out.append(f"step {self.first_bad_step}: non-finite rows belong to {who}")
        if self.reached:
            out.append("spread to other requests: " + "; ".join(
                f"{h.request_id} at step {h.step}" for h in self.reached))
        elif self.followed_steps > 1:
            out.append(f"no other request was reached in the {self.followed_steps} steps read")
        if self.clean:
            out.append(f"requests never hit: {', '.join(self.clean[:8])}"
                       + (f" (+{len(self.clean) - 8} more)" if len(self.clean) > 8 else ""))
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


def _row_flags(trace: Trace, recs: Table, root_id: int, slot: int) -> np.ndarray | None:
    r = np.nonzero((recs["module_id"] == root_id) & (recs["io"] == schema.IO_OUTPUT)
                   & (recs["slot"] == slot))[0]
    if not len(r):
        return None
    off, n = int(recs["tok_offset"][r[0]]), int(recs["tok_count"][r[0]])
    if off < 0 or n <= 0:
        return None
    return trace.token_span(off, off + n) > 0


def _hits(step: int, rows: Table, hid: np.ndarray | None, lg: np.ndarray | None,
          req_ids: dict[int, str]) -> list[RequestHit]:
    at = np.nonzero(rows["step"] == step)[0]  # this step's token rows, batch order
    request = rows["request"]
    order = list(dict.fromkeys(request[at].tolist()))  # batch order = logits row order
    bad: dict[int, list[int]] = {}
    if hid is not None and len(at):
        n = min(len(hid), len(at))
        for i in at[:n][hid[:n]]:
            bad.setdefault(int(request[i]), []).append(int(i))
    bad_logits = set()
    if lg is not None:
        bad_logits = {int(order[i]) for i in np.nonzero(lg)[0] if i < len(order)}
    out = []
    for req in list(dict.fromkeys(list(bad) + sorted(bad_logits))):
        g = np.asarray(bad.get(req, []), dtype=np.int64)
        phases = {schema.ENGINE_PHASES.get(int(p), "unknown") for p in rows["phase"][g]}
        out.append(RequestHit(
            request_id=req_ids.get(req, f"#{req}"), step=step, rows=len(g),
            positions=[int(p) for p in rows["position"][g[:8]]],
            phase=phases.pop() if len(phases) == 1 else ("mixed" if phases else "unknown"),
            logits=req in bad_logits))
    return out


def find_engine_findings(trace: Trace, first_bad_step: int | None,
                         producer: str | None = None) -> EngineFindings | None:
    info = engine_info(trace.meta)
    if info is None:
        return None
    reqs = trace.engine_columns("requests")
    req_ids = {int(r): str(i) for r, i in zip(reqs["request"], reqs["request_id"])}
    ef = EngineFindings(engine=str(info.get("name", "engine")),
                        version=str(info.get("version", "unknown")), n_requests=len(reqs),
                        warmup_steps=[int(s) for s in warmup_steps(trace)],
                        first_bad_step=first_bad_step)
    if producer:
        health = info.get("scale_health")
        h = health.get(producer) if isinstance(health, dict) else None
        if isinstance(h, dict):
            ef.producer = producer
            ef.producer_scales = {k: v for k, v in h.items() if isinstance(v, dict)}
    if first_bad_step is None:
        return ef
    rows = trace.engine_columns("rows")
    kinds = trace.module_kinds.tolist()
    root_id = kinds.index("root") if "root" in kinds else len(kinds) - 1
    steps = [int(s) for s in trace.step_table["step"] if s >= first_bad_step][:MAX_FOLLOW_STEPS]
    seen: set[str] = set()
    for i, step in enumerate(steps):
        recs = trace.record_table(step)
        hid = _row_flags(trace, recs, root_id, schema.ENGINE_ROW_FLAG_SLOTS["hidden"])
        lg = _row_flags(trace, recs, root_id, schema.ENGINE_ROW_FLAG_SLOTS["logits"])
        hits = _hits(step, rows, hid, lg, req_ids)
        if i == 0:
            ef.first = hits
        else:
            ef.reached += [h for h in hits if h.request_id not in seen]
        seen.update(h.request_id for h in hits)
    ef.followed_steps = len(steps)
    _origin(trace, ef, rows, req_ids)
    ef.clean = [rid for rid in req_ids.values() if rid not in seen]
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
