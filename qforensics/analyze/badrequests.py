"""Every request of a serving-engine run that went bad, and whether it was reached from another
request or went bad on its own (and then, at the same position or length as others: a
position- or length-dependent cause).

Reads the root module's row-flag records (schema.ENGINE_ROW_FLAG_SLOTS) of every step that has
them, picked from the narrow record columns the reader keeps (a flag record's absmax is 1.0 when
one of its rows is non-finite), their per-token values in a few merged reads, the /engine
tables, and, at each step where a request first went bad, that step's records and per-token
maxima (which request's rows held NaN/Inf at the earliest op of that forward). Steps whose full
detail the trace no longer holds (the byte budget) are counted, never guessed; a request whose
first bad step is among them is named from /engine/hits, the writer's record of it. The lines
and the groups by position or length are analyze/badtext.py's. No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from qforensics.analyze.badtext import (
    BadRequest,
    SameSpot,
    group_same_spots,
    mark_via_kv_cache,
    reached_on_its_own,
    request_head,
    request_line,
)
from qforensics.trace import schema
from qforensics.trace.hits import earliest_bad
from qforensics.trace.reader import Trace
from qforensics.trace.table import Table

__all__ = ["BadRequest", "RunHits", "SameSpot", "classify", "scan_hits"]

_READ_SPAN = 1 << 16  # per-token values read in one go when flag records lie this close


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
class RunHits:
    hits: dict[int, list[RequestHit]] = field(default_factory=dict)  # step -> requests hit
    req: dict[str, int] = field(default_factory=dict)  # request id -> /engine/requests index
    steps_read: int = 0  # steps whose row flags were read
    logits_rows: int = 0  # bad logits rows in them (what the summaries count)


def _flag_records(trace: Trace, root_id: int, warm: np.ndarray) -> dict[int, dict[int, tuple]]:
    """step -> slot -> (tok_offset, tok_count) of the root's row-flag records with a bad row."""
    cols = trace.record_columns(["step", "module_id", "io", "slot", "absmax", "tok_offset",
                                 "tok_count"])
    slots = list(schema.ENGINE_ROW_FLAG_SLOTS.values())
    a = cols["absmax"]
    sel = ((cols["module_id"] == root_id) & (cols["io"] == schema.IO_OUTPUT)
           & np.isin(cols["slot"], slots) & ((a > 0) | ~np.isfinite(a))
           & (cols["tok_offset"] >= 0) & (cols["tok_count"] > 0))
    sel &= ~np.isin(cols["step"], warm)
    out: dict[int, dict[int, tuple]] = {}
    for i in np.nonzero(sel)[0]:
        out.setdefault(int(cols["step"][i]), {})[int(cols["slot"][i])] = (
            int(cols["tok_offset"][i]), int(cols["tok_count"][i]))
    return out


def _read_spans(trace: Trace, spans: list[tuple[int, int]]) -> dict[tuple[int, int], np.ndarray]:
    """Per-token values of many short spans, neighbours merged into one read."""
    out: dict[tuple[int, int], np.ndarray] = {}
    todo = sorted(set(spans))
    i = 0
    while i < len(todo):
        lo = todo[i][0]
        j, hi = i, todo[i][0] + todo[i][1]
        while j + 1 < len(todo) and todo[j + 1][0] + todo[j + 1][1] - lo <= _READ_SPAN:
            j += 1
            hi = max(hi, todo[j][0] + todo[j][1])
        block = trace.token_span(lo, hi)
        for off, n in todo[i:j + 1]:
            out[(off, n)] = block[off - lo:off - lo + n]
        i = j + 1
    return out


class StepRows:
    """The /engine/rows of each step, found by one sort instead of a scan per step."""

    def __init__(self, rows: Table) -> None:
        self.rows = rows
        st = np.asarray(rows["step"], np.int64)
        self.order = np.argsort(st, kind="stable")
        self.sorted = st[self.order]

    def at(self, step: int) -> np.ndarray:
        lo, hi = np.searchsorted(self.sorted, [step, step + 1])
        return self.order[lo:hi]


def step_hits(step: int, sr: StepRows, hid: np.ndarray | None, lg: np.ndarray | None,
              req_ids: dict[int, str]) -> list[RequestHit]:
    rows = sr.rows
    at = sr.at(step)  # this step's token rows, batch order
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
    for req in list(dict.fromkeys(list(bad) + [r for r in order if r in bad_logits])):
        g = np.asarray(bad.get(req, []), dtype=np.int64)
        phases = {schema.ENGINE_PHASES.get(int(p), "unknown") for p in rows["phase"][g]}
        out.append(RequestHit(
            request_id=req_ids.get(req, f"#{req}"), step=step, rows=len(g),
            positions=[int(p) for p in rows["position"][g[:8]]],
            phase=phases.pop() if len(phases) == 1 else ("mixed" if phases else "unknown"),
            logits=req in bad_logits))
    return out


def scan_hits(trace: Trace, sr: StepRows, req_ids: dict[int, str], root_id: int,
              warm: np.ndarray) -> RunHits:
    """The requests hit at every step whose row flags the trace holds, in step order."""
    flags = _flag_records(trace, root_id, warm)
    run = RunHits(req={v: k for k, v in req_ids.items()})
    if not flags:
        return run
    values = _read_spans(trace, [s for d in flags.values() for s in d.values()])
    hs, ls = schema.ENGINE_ROW_FLAG_SLOTS["hidden"], schema.ENGINE_ROW_FLAG_SLOTS["logits"]
    for step in sorted(flags):
        d = flags[step]
        hid = values[d[hs]] > 0 if hs in d else None
        lg = values[d[ls]] > 0 if ls in d else None
        if not len(sr.at(step)):
            continue  # flags without token rows: counted as unattributed by the caller
        run.steps_read += 1
        run.logits_rows += int(lg.sum()) if lg is not None else 0
        hits = step_hits(step, sr, hid, lg, req_ids)
        if hits:
            run.hits[step] = hits
    return run


Op = tuple[int, list[int], str]  # (call index, token rows (-1: its logits row), module)


def first_ops(trace: Trace, step: int, sr: StepRows) -> dict[int, Op]:
    """request index -> the earliest record (inputs before outputs) of `step` whose per-token
    maxima hold NaN/Inf in that request's rows."""
    try:
        recs = trace.record_table(step)
    except Exception:  # noqa: BLE001 - a step outside /steps, or unreadable: not known
        return {}
    at = sr.at(step)
    request = sr.rows["request"][at]
    kinds = trace.module_kinds
    toff, tcnt = recs["tok_offset"], recs["tok_count"]
    keep = ~((kinds[recs["module_id"]] == "root") & (recs["slot"] > 0))
    idx = np.nonzero(keep & (toff >= 0) & (tcnt > 0))[0]
    if not len(idx) or not len(at):
        return {}
    lo, hi = int(toff[idx].min()), int((toff[idx] + tcnt[idx]).max())
    try:
        tok = trace.token_span(lo, hi)
    except Exception:  # noqa: BLE001
        return {}
    return {q: (int(recs["call_index"][i]), [int(at[x]) for x in rows] or [-1],
                str(recs["module"][i]))
            for q, (i, rows) in earliest_bad(recs, keep, tok, lo, request).items()}


def _where(trace: Trace, h: RequestHit, op: Op | None, mine: np.ndarray, sr: StepRows
           ) -> tuple[int | None, int | None, int | None]:
    """(first bad position, length, input token there) of a request at its first bad step."""
    pos = sr.rows["position"]
    length = int(pos[mine].max()) + 1 if len(mine) else None
    row = None
    if op is not None and op[1] and op[1][0] >= 0:
        row = min(op[1], key=lambda i: int(pos[i]))
    elif h.positions and len(mine):
        hit = mine[np.isin(pos[mine], h.positions)]
        row = int(hit[0]) if len(hit) else None
    elif len(mine):  # its logits row only: the request's last token row of the step
        row = int(mine[np.argmax(pos[mine])])
    if row is None:
        return None, length, None
    token = None
    try:
        ids = trace.input_ids(h.step)
        r = int(sr.rows["row"][row])
        token = int(ids[r]) if 0 <= r < len(ids) else None
    except Exception:  # noqa: BLE001 - input ids not recorded for this step
        token = None
    return int(pos[row]), length, token


def from_hits(trace: Trace, hits: Table, reqs: Table, known: set[str]) -> list[BadRequest]:
    """The requests /engine/hits names (the writer's record of where each first held NaN/Inf)
    that are not in `known` (found in the full detail): those whose first bad step is past the
    detail the byte budget kept."""
    ids = {int(i): str(r) for i, r in zip(reqs["request"], reqs["request_id"])}
    prompt = {int(i): int(p) for i, p in zip(reqs["request"], reqs["prompt_tokens"])}
    names = trace.module_names
    out = []
    for k in np.argsort(hits["step"], kind="stable"):
        q = int(hits["request"][k])
        rid = ids.get(q, f"#{q}")
        if rid in known:
            continue
        known.add(rid)
        mod = int(hits["module_id"][k])

        def opt(col: str) -> int | None:
            v = int(hits[col][k])
            return v if v >= 0 else None
        b = BadRequest(rid, int(hits["step"][k]), opt("position"), opt("length"),
                       prompt.get(q), schema.ENGINE_PHASES.get(int(hits["phase"][k]), "mixed"),
                       int(hits["rows"][k]), bool(hits["logits"][k]), opt("token"),
                       str(names[mod]) if 0 <= mod < len(names) else "")
        if int(hits["call_index"][k]) < 0:
            b.line = request_head(b) + ": its row flags say so; the op is not recorded"
        elif int(hits["earlier"][k]):
            b.kind, b.spread_unnamed = "possibly_spread", int(hits["earlier"][k])
            b.line = request_line(b, [], {}, [])
        else:
            b.kind = "independent"
            b.line = request_head(b) + (": on its own (no other request held NaN/Inf at an earlier "
                                 "op of that forward)")
        out.append(b)
    return out


def classify(trace: Trace, run: RunHits, sr: StepRows, reqs: Table, hits: Table | None = None
             ) -> tuple[list[BadRequest], list[SameSpot]]:
    """Each request that went bad, in order, with how (see `BadRequest.kind`), and the groups
    of requests that went bad on their own at one position or length; `hits`: /engine/hits,
    for the requests whose first bad step has no full detail left."""
    first: dict[str, RequestHit] = {}
    for step in sorted(run.hits):
        for h in run.hits[step]:
            first.setdefault(h.request_id, h)
    since = {rid: h.step for rid, h in first.items()}
    prompt = {str(i): int(p) for i, p in zip(reqs["request_id"], reqs["prompt_tokens"])}
    ops: dict[int, dict[int, Op]] = {}
    out: list[BadRequest] = []
    for rid, h in first.items():
        s = h.step
        if s not in ops:
            ops[s] = first_ops(trace, s, sr)
        ri = run.req.get(rid, -1)
        at = sr.at(s)
        mine = at[sr.rows["request"][at] == ri]
        op = ops[s].get(ri)
        position, length, token = _where(trace, h, op, mine, sr)
        b = BadRequest(rid, s, position, length, prompt.get(rid), h.phase, h.rows, h.logits,
                       token, op[2] if op else "")
        others = [x.request_id for x in run.hits[s] if x.request_id != rid]
        carriers = [x for x in others if since[x] < s]
        b.together_with = [x for x in others if since[x] == s]
        mine_call = op[0] if op else None
        cands, same, unknown = [], [], False
        for x in others:
            t = ops[s].get(run.req.get(x, -1))
            if t is None or mine_call is None:
                cands.append(x)
                unknown = True
            elif t[0] < mine_call or (t[0] == mine_call and x in carriers):
                cands.append(x)
            elif t[0] == mine_call:
                same.append(x)
        if not cands:
            b.kind = "independent"
        elif any(x in carriers for x in cands) or not unknown:
            b.kind, b.spread_from = "possibly_spread", cands
        b.line = request_line(b, carriers, since, others, same)
        out.append(b)
    if hits is not None and len(hits):
        out = sorted(out + from_hits(trace, hits, reqs, set(first)), key=lambda b: b.step)
    reached_on_its_own(out)
    mark_via_kv_cache(out)
    spots = group_same_spots(out)
    for b in out:
        b.same_position_as = [x.request_id for x in out if x is not b and b.position is not None
                              and x.position == b.position]
        b.same_length_as = [x.request_id for x in out if x is not b and b.length is not None
                            and x.length == b.length]
    for sp in spots:  # lines again: the kinds the groups gave
        for b in out:
            if b.request_id in sp.requests and b.kind == f"independent_same_{sp.by}":
                b.line = request_line(b, [x for x in sp.requests if x != b.request_id], since, [])
    return out, spots
