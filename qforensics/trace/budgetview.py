"""The reader's side of the byte budget (format 1.2): every step's summary, the ring's full
detail of the last steps, and the pinned windows. A mixin of `Trace` (trace/reader.py).

Each dataset is untrusted: compound rows are checked field by field (names, kinds, shapes),
rows that contradict themselves are dropped, and ring slots are used only when their index,
their step row and their counts agree. A file before 1.2 has none of these: `summary_table`
is None, no ring detail, no pinned rows. No torch import.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import h5py
import numpy as np

from qforensics.trace import schema
from qforensics.trace.table import Table

__all__ = ["BudgetView", "RING_ROW_BASE"]

_ERR = (OSError, RuntimeError, KeyError, ValueError, TypeError)
# record rows of ring detail are numbered from here in the tables handed out (never a /records
# row: those are below 2**62)
RING_ROW_BASE = 1 << 62


def _compound(ds: Any, columns: list, ndim: int) -> bool:
    if not isinstance(ds, h5py.Dataset) or ds.ndim != ndim or ds.dtype.names is None:
        return False
    for name, dt, shape in columns:
        if name not in ds.dtype.names:
            return False
        got = ds.dtype.fields[name][0]
        base = got.base if got.shape else got
        if tuple(got.shape) != tuple(shape) or base.kind not in (
                "iu" if np.dtype(dt).kind in "iu" else np.dtype(dt).kind):
            return False
    return True


class BudgetView:
    _f: h5py.File
    path: str
    unreadable: list[str]

    @cached_property
    def summary_state(self) -> dict[str, int] | None:
        ds = self._f.get(schema.SUMMARY_STATE)
        if not isinstance(ds, h5py.Dataset) or ds.shape != (4,) or ds.dtype.kind not in "iu":
            return None
        try:
            v = [int(x) for x in ds[:]]
        except _ERR:
            return None
        return dict(zip(("resolution", "rows_used", "steps_seen", "capacity"), v))

    @cached_property
    def summary_table(self) -> Table | None:
        """The non-empty /summary rows in step order (None: not a 1.2 file, or unreadable)."""
        ds = self._f.get(schema.SUMMARY_BLOCKS)
        if ds is None:
            return None
        if not _compound(ds, schema.SUMMARY_COLUMNS, 1):
            self.unreadable.append("/summary/blocks is malformed")
            return None
        try:
            raw = ds[:]
        except _ERR as exc:
            self.unreadable.append(f"/summary/blocks ({exc})")
            return None
        cols = {n: np.asarray(raw[n]).astype(np.dtype(t)) for n, t, _ in schema.SUMMARY_COLUMNS}
        used = cols["count"] > 0
        ok = used & (cols["step_lo"] >= 0) & (cols["step_hi"] >= cols["step_lo"]) & (
            cols["count"] <= cols["step_hi"] - cols["step_lo"] + 1)
        for k in ("nonfinite_steps", "logits_nan", "logits_inf", "nonfinite_records",
                  "incomplete", "warmup", "bad_requests", "logits_steps"):
            ok &= cols[k] >= 0
        ok &= cols["nonfinite_steps"] <= cols["count"]
        ok &= (cols["first_nonfinite_step"] < 0) == (cols["nonfinite_steps"] == 0)
        if (used & ~ok).any():
            self.unreadable.append(f"/summary/blocks: {int((used & ~ok).sum())} rows contradict "
                                   "themselves (dropped)")
        order = np.argsort(cols["step_lo"][ok], kind="stable")
        cols = {k: v[ok][order] for k, v in cols.items()}
        if len(order) > 1 and (cols["step_lo"][1:] <= cols["step_hi"][:-1]).any():
            self.unreadable.append("/summary/blocks rows overlap")
        return Table(cols)

    @cached_property
    def pinned_table(self) -> Table:
        g = self._f.get("pinned")
        cols: dict[str, np.ndarray] = {n: np.zeros(0, np.dtype(t)) for n, t, _ in
                                       schema.PINNED_COLUMNS}
        if not isinstance(g, h5py.Group):
            return Table(cols)
        try:
            ds = {n: g.get(n) for n in cols}
            if not all(isinstance(d, h5py.Dataset) and d.ndim == 1 for d in ds.values()):
                raise ValueError("columns missing or not 1-D")
            n = min(d.shape[0] for d in ds.values())
            cols = {k: d[:n] for k, d in ds.items()}
        except _ERR as exc:
            self.unreadable.append(f"/pinned ({exc})")
            return Table({k: v[:0] for k, v in cols.items()})
        cols["kind"] = np.array([v.decode("ascii", "replace") if isinstance(v, bytes) else str(v)
                                 for v in cols["kind"]], dtype=object)
        return Table(cols)

    @cached_property
    def _ring_detail(self) -> dict[int, int]:
        """step -> ring slot, for slots holding a step's full detail."""
        need = {p: self._f.get(p) for p in (schema.RING_STEPS, schema.RING_RECORDS,
                                            schema.RING_TOKENS, schema.RING_DETAIL, "ring/step")}
        if need[schema.RING_STEPS] is None:
            return {}
        if not (_compound(need[schema.RING_STEPS], schema.STEP_COLUMNS, 1)
                and _compound(need[schema.RING_RECORDS], schema.RECORD_COLUMNS, 2)
                and isinstance(need[schema.RING_TOKENS], h5py.Dataset)
                and need[schema.RING_TOKENS].ndim == 2
                and need[schema.RING_TOKENS].dtype.kind == "f"
                and isinstance(need[schema.RING_DETAIL], h5py.Dataset)
                and need[schema.RING_DETAIL].ndim == 2
                and need[schema.RING_DETAIL].shape[1:] == (2,)
                and need[schema.RING_DETAIL].dtype.kind in "iu"
                and isinstance(need["ring/step"], h5py.Dataset)):
            self.unreadable.append("/ring detail datasets are malformed")
            return {}
        k = need[schema.RING_STEPS].shape[0]
        if not (need[schema.RING_RECORDS].shape[0] == need[schema.RING_TOKENS].shape[0]
                == need[schema.RING_DETAIL].shape[0] == need["ring/step"].shape[0] == k):
            self.unreadable.append("/ring detail datasets differ in slots")
            return {}
        try:
            owner = need["ring/step"][:].astype(np.int64)
            rows = need[schema.RING_STEPS]["step"].astype(np.int64)
            det = need[schema.RING_DETAIL][:].astype(np.int64)
        except _ERR as exc:
            self.unreadable.append(f"/ring detail ({exc})")
            return {}
        r_cap, t_cap = need[schema.RING_RECORDS].shape[1], need[schema.RING_TOKENS].shape[1]
        self._ring_ds = need
        out = {}
        for slot in range(k):
            st, n_rec, n_tok = int(owner[slot]), int(det[slot, 0]), int(det[slot, 1])
            if (st >= 0 and int(rows[slot]) == st and 0 < n_rec <= r_cap and 0 <= n_tok <= t_cap
                    and st % k == slot):
                out[st] = slot
        return out

    def ring_detail_steps(self) -> list[int]:
        """Steps whose full detail (step row, records, per-token maxima) the ring holds."""
        return sorted(self._ring_detail)

    def ring_step(self, step: int) -> tuple[Table, Table, np.ndarray] | None:
        """(the step's row as a one-row step Table, its records as a record Table with rows
        numbered from RING_ROW_BASE + slot * R, its per-token maxima) from the ring, or None.
        Channel offsets are resolved into the reader's address space; `slot_tok_offset` is
        into the returned array (`tok_offset` is -1: nothing in /tokens/absmax)."""
        slot = self._ring_detail.get(int(step))
        if slot is None:
            return None
        ds = self._ring_ds
        try:
            n_rec, n_tok = (int(x) for x in ds[schema.RING_DETAIL][slot])
            srow = ds[schema.RING_STEPS][slot:slot + 1]
            recs = ds[schema.RING_RECORDS][slot, :n_rec]
            tok = ds[schema.RING_TOKENS][slot, :n_tok].astype(np.float32)
        except _ERR as exc:
            self.unreadable.append(f"/ring slot {slot} ({exc})")
            return None
        r_cap = ds[schema.RING_RECORDS].shape[1]
        cols = {"row": RING_ROW_BASE + slot * r_cap + np.arange(n_rec, dtype=np.int64)}
        for n, t, _ in schema.RECORD_COLUMNS:
            cols[n] = np.asarray(recs[n]).astype(np.dtype(t))
        n_mod = self.n_modules  # type: ignore[attr-defined]
        mid = cols["module_id"]
        if len(mid) and (int(mid.min()) < 0 or int(mid.max()) >= n_mod):
            self.unreadable.append(f"/ring slot {slot}: module ids out of range")
            return None
        if (cols["step"] != int(step)).any():
            self.unreadable.append(f"/ring slot {slot}: records of another step")
            return None
        cols["chan_offset"] = self._ring.resolve(  # type: ignore[attr-defined]
            cols["chan_offset"], cols["flags"], cols["step"], cols["channels"])
        bad_tok = (cols["tok_offset"] < 0) | (cols["tok_count"] < 0) | (
            cols["tok_offset"] + cols["tok_count"] > n_tok)
        # token offsets are into the returned array, not /tokens/absmax: kept apart
        cols["slot_tok_offset"] = np.where(bad_tok, -1, cols["tok_offset"])
        cols["tok_offset"] = np.full(n_rec, -1, np.int64)
        cols["module"] = self.module_names[mid]  # type: ignore[attr-defined]
        scols = {n: np.asarray(srow[n]).astype(np.dtype(t)) for n, t, _ in schema.STEP_COLUMNS}
        rel = scols["first_nonfinite_record"]
        scols["first_nonfinite_record"] = np.where(
            (rel >= 0) & (rel < n_rec), cols["row"][0] + rel if n_rec else -1, -1)
        return Table(scols), Table(cols), tok
