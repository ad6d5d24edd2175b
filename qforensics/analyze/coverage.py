"""Which steps a trace saw, and at what resolution (format 1.2's byte budget), and where the
first failure lies when the full-detail tables no longer hold it.

A trace keeps every step's summary (`/summary`, rows of `resolution` steps), the full detail of
the steps appended before the budget was reached, of the pinned windows and of the last steps
in the ring. The verdict covers what the summaries saw, and says so; a file before 1.2 that
stopped appending at its cap says that the steps after it were not seen. No torch import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qforensics.trace.reader import Trace
from qforensics.trace.table import Table

__all__ = ["Coverage", "find_coverage", "ring_failure", "snapshot_corruption",
           "summary_failure"]


def _spans(steps: np.ndarray) -> list[tuple[int, int]]:
    """Sorted step numbers as inclusive runs."""
    if not len(steps):
        return []
    s = np.unique(np.asarray(steps, np.int64))
    cut = np.nonzero(np.diff(s) != 1)[0]
    lo = np.concatenate([[0], cut + 1])
    hi = np.concatenate([cut, [len(s) - 1]])
    return [(int(s[a]), int(s[b])) for a, b in zip(lo, hi)]


def _words(spans: list[tuple[int, int]], most: int = 4) -> str:
    parts = [f"{a}" if a == b else f"{a}-{b}" for a, b in spans[:most]]
    if len(spans) > most:
        parts.append(f"+{len(spans) - most} more spans")
    return ", ".join(parts)


@dataclass
class Coverage:
    """What the verdict covers. `steps_seen`: steps in the summaries (or in /steps before
    1.2); `detail`: inclusive spans of steps with full detail in /steps; `ring`: steps whose
    full detail only the ring holds; `resolution`: steps per summary row (1: every step);
    `stopped_at`: the step at which appending of full detail stopped (-1: never)."""

    steps_seen: int
    first_step: int
    last_step: int
    detail: list[tuple[int, int]] = field(default_factory=list)
    ring: list[int] = field(default_factory=list)
    resolution: int = 1
    stopped_at: int = -1
    summaries: bool = False  # a 1.2 file: every step's summary is there
    pinned: list[dict[str, Any]] = field(default_factory=list)
    first_nonfinite_step: int | None = None  # from the summaries
    first_nonfinite_call: int = -1
    nonfinite_steps: int = 0
    bad_requests: int = 0
    writer_error: str = ""  # trace writing failed (disk full, ...): the status's words
    unseen_from: int = -1  # the first step the capture ran that nothing in the file holds

    @staticmethod
    def _int(v: Any) -> int:
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else -1

    @property
    def thinned(self) -> bool:
        """Appending stopped, or steps the summaries saw lack their detail before the last
        detailed one (a tail cut by a kill is the truncation the end reason names)."""
        if self.stopped_at >= 0 or self.unseen_from >= 0:
            return True
        if not self.detail:
            return self.steps_seen > 0 and self.summaries
        last = self.detail[-1][1]
        n_detail = sum(b - a + 1 for a, b in self.detail)
        return n_detail < last - self.first_step + 1 or (
            self.summaries and self.last_step > last and bool(self.ring))

    @property
    def blind(self) -> bool:
        """Recording stopped and nothing summarizes the steps after it (a 1.1 file, or a
        write that failed and whose summaries could not be written at close)."""
        return (self.stopped_at >= 0 and not self.summaries) or self.unseen_from >= 0

    def line(self) -> str:
        if not self.thinned:
            return ""
        det = _words(self.detail) or "none"
        why = (f"trace writing failed ({self.writer_error})" if self.writer_error
               else "max_bytes reached")
        if self.blind:
            at = self.unseen_from if self.unseen_from >= 0 else self.stopped_at
            return (f"recording stopped at step {at} ({why}) and this trace keeps no "
                    f"summaries of later steps; full detail: steps {det}")
        res = "every step" if self.resolution == 1 else f"{self.resolution} steps a row"
        out = (f"covers steps {self.first_step}-{self.last_step} ({self.steps_seen} steps) "
               f"through every step's summary ({res}); full detail for steps {det}")
        if self.ring:
            out += f" and, in the ring, {_words(_spans(np.array(self.ring)))}"
        if self.stopped_at >= 0:
            out += (f"; appending of full detail stopped at step {self.stopped_at}"
                    + (f" ({why}; later steps were kept in memory and written at close)"
                       if self.writer_error else ""))
        firsts: dict[str, dict[str, Any]] = {}
        for p in self.pinned:
            if p["kept"]:
                firsts.setdefault(p["kind"], p)
        if firsts:
            out += "; pinned: " + ", ".join(f"first {k} step {p['step']} (with steps from "
                                              f"{p['window_lo']})" for k, p in firsts.items())
        later = sum(1 for p in self.pinned if p["kept"]) - len(firsts)
        dropped = sum(1 for p in self.pinned if not p["kept"])
        if later or dropped:
            out += f"; later triggered steps: {later} kept, {dropped} not (no room left)"
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"steps_seen": self.steps_seen, "first_step": self.first_step,
                "last_step": self.last_step, "detail": [list(s) for s in self.detail],
                "ring": self.ring, "resolution": self.resolution,
                "stopped_at": self.stopped_at, "summaries": self.summaries,
                "pinned": self.pinned, "first_nonfinite_step": self.first_nonfinite_step,
                "nonfinite_steps": self.nonfinite_steps, "bad_requests": self.bad_requests,
                "writer_error": self.writer_error, "unseen_from": self.unseen_from,
                "line": self.line()}


def find_coverage(trace: Trace, steps: Table, warm: np.ndarray | None = None) -> Coverage:
    """The coverage of one trace (`steps`: its /steps rows, warm-ups left out; `warm`: the
    warm-up steps, whose non-finite summaries never count: vLLM's compiled warm-up forward runs
    on a dummy batch)."""
    st = np.asarray(steps["step"], np.int64) if not steps.empty else np.zeros(0, np.int64)
    lim = trace.limits
    stopped = int(lim.get("reached_at_step", -1))
    summ = trace.summary_table
    ring = [s for s in trace.ring_detail_steps() if not np.isin(s, st)]
    pins = trace.pinned_table
    pinned = [{"step": int(pins["step"][i]), "kind": str(pins["kind"][i]),
               "window_lo": int(pins["window_lo"][i]), "kept": bool(pins["kept"][i])}
              for i in range(len(pins))]
    if summ is None or not len(summ):
        lo = int(st.min()) if len(st) else 0
        hi = int(st.max()) if len(st) else -1
        return _written(trace, Coverage(len(st), lo, hi, _spans(st), ring, 1, stopped, False,
                                        pinned))
    state = trace.summary_state or {}
    cov = Coverage(int(summ["count"].sum()), int(summ["step_lo"][0]),
                   int(summ["step_hi"][-1]), _spans(st), ring,
                   max(1, int(state.get("resolution", 1))), stopped, True, pinned)
    first_bad = np.asarray(summ["first_nonfinite_step"], np.int64)
    bad = np.nonzero((first_bad >= 0) & ~np.isin(first_bad, warm if warm is not None
                                                    else np.zeros(0, np.int64)))[0]
    if len(bad):
        cov.first_nonfinite_step = int(summ["first_nonfinite_step"][bad[0]])
        cov.first_nonfinite_call = int(summ["first_nonfinite_call"][bad[0]])
    cov.nonfinite_steps = int(summ["nonfinite_steps"].sum())
    cov.bad_requests = int(summ["bad_requests"].sum())
    return _written(trace, cov)


def _short_error(text: str) -> str:
    """An HDF5 write error in a few words: its type and the system's message (HDF5 quotes
    errno's text as error message = '...'), else its first line."""
    m = re.search(r"error message = '([^'\n]{1,80})'", text)
    head = text.split(":", 1)[0] if ":" in text[:40] else ""
    if m:
        return f"{head}: {m.group(1)}" if head else m.group(1)
    return text.splitlines()[0][:120] if text else ""


def _written(trace: Trace, cov: Coverage) -> Coverage:
    """A write that failed (trace/fallback.py): detail stops at the failed step, and the
    steps the capture ran past what the file holds were not seen."""
    status = trace.meta.get("status")
    if not isinstance(status, dict) or not status.get("writer_error"):
        return cov
    cov.writer_error = _short_error(str(status["writer_error"]))
    at = Coverage._int(status.get("writer_failed_at_step"))
    if at >= 0:
        cov.stopped_at = at if cov.stopped_at < 0 else min(cov.stopped_at, at)
    ran = Coverage._int(status.get("steps"))  # steps the capture counted (0-based: ran - 1)
    if ran > 0 and cov.last_step < ran - 1:
        cov.unseen_from = max(cov.last_step + 1, 0)
    return cov


def summary_failure(cov: Coverage | None, steps: Table, fail_row: int | None) -> int | None:
    """The first non-finite step by the summaries when /steps does not hold it (or only a
    later one): where the analysis must look in the ring, or report from the summary."""
    if cov is None or cov.first_nonfinite_step is None:
        return None
    s = cov.first_nonfinite_step
    if fail_row is not None and int(steps["step"][fail_row]) <= s:
        return None
    return s


def ring_failure(trace: Trace, step: int) -> tuple[Table, Table] | None:
    """A failing step held only by the ring: (its step row, its records), with the row's
    record offsets past /records so that the spread reads nothing after it."""
    got = trace.ring_step(step)
    if got is None:
        return None
    srow, recs, _ = got
    cols = {k: np.array(srow[k]) for k in srow.columns}
    cols["record_offset"] = np.full(1, trace.records_end, np.int64)
    cols["record_count"] = np.zeros(1, np.int64)
    return Table(cols), recs


_PARAMS = ("weight", "bias", "qweight", "qzeros", "scales", "weight_packed", "weight_scale",
           "weight_zero_point", "input_scale")


def snapshot_corruption(trace: Trace, call_index: int) -> list[dict[str, Any]]:
    """The producer's own tensors in the snapshot of its failing call that hold NaN/Inf (the
    parameter health taken at attach cannot see a value corrupted later)."""
    try:
        t = trace.snapshot_table
        if not len(t) or not (t["call_index"] == int(call_index)).any():
            return []
        tensors = trace.snapshot_tensors(int(call_index))
    except Exception:  # noqa: BLE001 - a malformed snapshot only loses this evidence
        return []
    out = []
    r0 = 0
    rows = tensors.get("weight_rows")
    if rows is not None and rows.size >= 1:
        r0 = int(rows.reshape(-1)[0])
    for name in _PARAMS:
        a = tensors.get(name)
        if a is None or a.dtype.kind != "f":
            continue
        bad = ~np.isfinite(a)
        n = int(bad.sum())
        if not n:
            continue
        idx = np.unravel_index(int(np.argmax(bad.reshape(-1))), a.shape)
        row = int(idx[0]) + (r0 if name == "weight" else 0) if a.ndim else 0
        out.append({"param": name, "nan": int(np.isnan(a).sum()), "inf": int(np.isinf(a).sum()),
                    "numel": int(a.size), "row": row,
                    "col": int(idx[-1]) if a.ndim > 1 else None})
    return out
