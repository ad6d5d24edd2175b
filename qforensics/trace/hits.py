"""Where each request of a serving-engine run first held NaN/Inf, found by the writer at the step
it happens and kept in /engine/hits (one row a request, from the room the budget keeps for the
requests table), so that a request hit after full detail stopped, or outside every pinned
window, is still named with its step, position, token and first module.

`first_hits` reads one step's batch (its records and per-token maxima, batch-local offsets)
with that step's /engine/rows; it runs on the writer's drainer, and only for a step whose
summary says it held NaN/Inf. Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qforensics.trace import schema
from qforensics.trace.badstep import step_is_bad
from qforensics.trace.batch import StepBatch

__all__ = ["earliest_bad", "first_hits"]


def _flagged(b: StepBatch, root: int, order: np.ndarray, request: np.ndarray
             ) -> dict[str, set[int]]:
    """{"logits" | "hidden": requests whose logits row / final hidden rows the root's row-flag
    records mark bad}."""
    r, tok = b.records, b.tok_absmax
    out: dict[str, set[int]] = {}
    for name, slot in schema.ENGINE_ROW_FLAG_SLOTS.items():
        out[name] = set()
        sel = np.nonzero((r["module_id"] == root) & (r["io"] == schema.IO_OUTPUT)
                         & (r["slot"] == slot) & (r["tok_offset"] >= 0))[0]
        for i in sel[:1]:
            lo, n = int(r["tok_offset"][i]), int(r["tok_count"][i])
            v = np.asarray(tok[lo:lo + n]) > 0
            who = order if name == "logits" else request
            out[name].update(int(x) for x in who[:len(v)][v[:len(who)]])
    return out


def earliest_bad(recs: Any, keep: np.ndarray, tok: np.ndarray, tok_base: int,
                 request: np.ndarray) -> dict[int, tuple[int, np.ndarray]]:
    """request -> (index of its record, its bad token rows) of the earliest record (inputs
    before outputs) among those `keep` marks whose per-token maxima hold NaN/Inf in that
    request's rows; an empty array of rows: only its row of a record with one row a request
    (the logits, lm_head). `recs`: record columns (call_index, io, tok_offset, tok_count);
    `tok`: per-token maxima from offset `tok_base`; `request`: the step's request per token
    row, in batch order (which is the order of the one-row-a-request records' rows)."""
    order = np.asarray(list(dict.fromkeys(request.tolist())), np.int64)
    n_tok, n_req = len(request), len(order)
    toff, tcnt = recs["tok_offset"], recs["tok_count"]
    idx = np.nonzero(keep & (toff >= 0) & (tcnt > 0))[0]
    idx = idx[np.lexsort((recs["io"][idx], recs["call_index"][idx]))]
    out: dict[int, tuple[int, np.ndarray]] = {}
    for i in idx:
        lo, n = int(toff[i]) - tok_base, int(tcnt[i])
        bad = np.nonzero(~np.isfinite(tok[lo:lo + n]))[0]
        if not len(bad):
            continue
        if n == n_req and n_req != n_tok:  # one row per request (logits, lm_head)
            per = {int(order[x]): np.zeros(0, np.int64) for x in bad if x < n_req}
        elif n >= n_tok:  # token rows (padding rows past them left out)
            bad = bad[bad < n_tok]
            per = {int(q): bad[request[bad] == q] for q in np.unique(request[bad])}
        else:
            continue
        for q, qrows in per.items():
            out.setdefault(q, (int(i), qrows))
        if len(out) == n_req:
            break
    return out


def first_hits(b: StepBatch, rows: np.ndarray, root: int, seen: set[int]) -> np.ndarray:
    """/engine/hits rows (schema.ENGINE_HIT_COLUMNS) of the requests of this one-step batch
    that hold NaN/Inf here for the first time (not in `seen`, which it updates). For each:
    the earliest record (inputs before outputs) whose per-token maxima hold NaN/Inf in its
    rows, and how many other requests held NaN/Inf at an earlier op of that forward (or at the
    same op, already bad before): 0 means it went bad on its own."""
    empty = np.zeros(0, schema.engine_dtype("hits"))
    s = b.steps
    if len(s) != 1 or not len(rows):
        return empty
    if not step_is_bad(s):
        return empty
    request = rows["request"].astype(np.int64)
    order = np.asarray(list(dict.fromkeys(request.tolist())), np.int64)  # logits row order
    n_tok = len(rows)
    flags = _flagged(b, root, order, request)
    flagged = flags["logits"] | flags["hidden"]
    r = b.records
    has_flags = bool(((r["module_id"] == root) & (r["slot"] > 0)).any())
    if has_flags and not (flagged - seen):
        return empty  # every request bad here was bad before: no scan of its records
    keep = ((r["nan_count"] > 0) | (r["inf_count"] > 0)) & ~(
        (r["module_id"] == root) & (r["slot"] > 0))
    first = {q: (int(r["call_index"][i]), i, qrows) for q, (i, qrows) in earliest_bad(
        r, keep, np.asarray(b.tok_absmax), 0, request).items()}  # request -> (call, record, rows)
    new = [q for q in order.tolist() if q not in seen and (q in first or q in flagged)]
    if not new:
        return empty
    out = np.zeros(len(new), schema.engine_dtype("hits"))
    pos, phase = rows["position"], rows["phase"]
    ids = np.asarray(b.input_ids)
    for k, q in enumerate(new):
        mine = np.nonzero(request == q)[0]
        call, rec, qrows = first.get(q, (-1, -1, np.zeros(0, np.int64)))
        if len(qrows):  # its first bad token row
            row = int(qrows[np.argmin(pos[qrows])])
        else:  # its logits row only: the request's last token row of the step
            row = int(mine[np.argmax(pos[mine])]) if len(mine) else -1
        ph = set(phase[mine].tolist())
        o = out[k]
        o["step"], o["request"] = int(s["step"][0]), q
        o["position"] = int(pos[row]) if row >= 0 else -1
        o["length"] = int(pos[mine].max()) + 1 if len(mine) else -1
        o["phase"] = ph.pop() if len(ph) == 1 else -1
        o["rows"] = len(qrows)
        o["logits"] = int(q in flags["logits"])
        o["token"] = int(ids[int(rows["row"][row])]) if row >= 0 and len(ids) == n_tok else -1
        o["call_index"] = call
        o["module_id"] = int(r["module_id"][rec]) if rec >= 0 else -1
        o["earlier"] = sum(1 for x, (c, _, _) in first.items() if x != q and call >= 0 and (
            c < call or (c == call and x in seen)))
        o["same_op"] = sum(1 for x, (c, _, _) in first.items()
                           if x != q and c == call and x not in seen)
    seen.update(new)
    return out


class HitsWriter:
    """A mixin of `TraceWriter` (with `BudgetWriter`): /engine/hits, on the drainer. A step's
    /engine/rows come in a batch of their own before its records (vLLM); they are held here
    until the step's batch comes."""

    _root: int
    _warm_steps: set[int]
    _req_reserve: int
    _req_used: int
    max_bytes: int
    _cols: dict[str, Any]
    hits_dropped = 0

    def _note_hits(self, batches: list[StepBatch]) -> None:
        if not hasattr(self, "_hit_rows"):
            self._hit_rows: dict[int, np.ndarray] = {}
            self._hit_seen: set[int] = set()
            self.hits_checked = np.zeros(3, np.int64)  # /engine/hits_checked
        for b in batches:
            er = b.engine.get("rows")
            if er is not None and len(er):
                for st in np.unique(er["step"]).tolist():
                    self._hit_rows[int(st)] = er[er["step"] == st]
            if len(b.steps) != 1:
                continue
            step = int(b.steps["step"][0])
            rows = self._hit_rows.pop(step, None)
            for old in [k for k in self._hit_rows if k < step]:  # a step whose batch never came
                del self._hit_rows[old]
            if not step_is_bad(b.steps, warmup=self._warm_steps):
                continue
            self.hits_checked[0] += 1  # a non-finite step: scanned when its rows came
            if rows is not None and len(rows):
                self.hits_checked[1] += 1
                new = first_hits(b, rows, self._root, self._hit_seen)
                if len(new):
                    self._write_hits(new)
            self.hits_checked[2] = self.hits_dropped
            self._cols[schema.HITS_CHECKED][:] = self.hits_checked

    def _write_hits(self, hits: np.ndarray) -> None:
        """Append within the room kept for the requests table (or what the windows leave)."""
        cols = schema.ENGINE_HIT_COLUMNS
        grow = self._growth({f"engine/hits/{n}": len(hits) for n, _, _ in cols})
        used = len(hits) * hits.dtype.itemsize
        own = used <= self._req_reserve - self._req_used and self._within_cap(grow)
        if not self.max_bytes or own or self._within_cap(grow + self._reserve(requests=True)):
            self._append_table("engine/hits", cols, hits)
            self._req_used += used
        else:
            self.hits_dropped += len(hits)
