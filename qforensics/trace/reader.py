"""Validating trace reader: numpy views (and, on request, pandas views) of a qforensics trace.

Trace files are untrusted input. The checks live in trace/validate.py: the reader checks the
format name and version (refusing a newer major version), refuses links, virtual datasets and
external storage, checks every column's dtype and every offset against the arrays it points into
(with Python ints), guards every data read, and never unpickles anything. A trace left behind by a
crashed or killed run (SWMR flags still set, columns of unequal length, a file cut short) is
opened as far as it goes and says where it ends; what could not be read is listed in
`Trace.unreadable`, and the analysis never calls such a trace PASSED.

The analysis reads `Table`s (numpy columns: `step_table`, `record_table()`, `record_columns()`);
the pandas views (`steps`, `records()`, `modules`, ...) are built from them on demand, so that
reading a trace never imports pandas. Each h5py object is looked up once per open file, and the
narrow record columns read for validation are kept for the analysis. No torch import.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from qforensics.errors import TraceFormatError, TraceUnreadableError
from qforensics.formats import MODULE_KINDS
from qforensics.trace import schema
from qforensics.trace.blocks import ChannelAccess
from qforensics.trace.budgetview import BudgetView
from qforensics.trace.sidetables import SideTables
from qforensics.trace.snapshots import SnapshotAccess
from qforensics.trace.table import Table
from qforensics.trace.tracefile import UNREADABLE_ERRORS, TraceFile, frozen_view
from qforensics.trace.validate import checked_span, parse_json, read, valid_spans

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["Trace", "TraceEnd", "open_trace"]


@dataclass(frozen=True)
class TraceEnd:
    complete: bool  # the writer closed the file
    last_step: int  # -1 when no step was written
    reason: str  # human sentence: how and where the trace ends


_HEALTH = ("nan_count", "inf_count")  # record columns every verdict depends on
# record columns the analysis reads over the whole trace: kept from the validating read
_KEEP = ("call_index", "step", "module_id", "io", "slot", "flags", "channels", "absmax",
         "nan_count", "inf_count", "chan_offset", "tok_offset", "tok_count")
_RECORD_TABLES_KEPT = 8  # record tables of single steps kept per open trace (a few KiB each)
_STEP_DOMAINS = (  # (column, lowest, highest or None)
    ("n_nonfinite_records", 0, None), ("logits_nan", 0, None), ("logits_inf", 0, None),
    ("n_calls", 0, None), ("record_count", 0, None), ("token_count", 0, None),
    ("first_nonfinite_call", -1, None), ("first_nonfinite_record", -1, None),
    ("complete", 0, schema.STEP_SPILLED), ("has_logits", 0, 1),
)


def _span_end(steps: dict[str, np.ndarray]) -> int:
    """max(offset + count) over step rows already checked by valid_spans (no wrap)."""
    if not len(steps["record_offset"]):
        return 0
    return int((steps["record_offset"] + steps["record_count"]).max())


def _parse_json(raw: Any, where: str) -> Any:
    return parse_json(raw, where)


class Trace(TraceFile, ChannelAccess, SnapshotAccess, SideTables, BudgetView):
    """An open trace. Use as a context manager or call `close()`.

    `meta` is a dict. numpy views: `step_table`, `record_table()`, `record_columns()`,
    `module_names` / `module_kinds`, `snapshot_table`, `incident_table`. pandas views (built
    on demand): `modules`, `steps`, `records()`, `snapshots`, `incidents`. Per-channel and
    per-token arrays come from `channel_block`, `channel_ranges` and `token_absmax`.
    """

    # -- after a failed write ----------------------------------------------------------------
    _unflushed_from_step = -1  # an older writer's status: /steps rows from this step on are out

    def _validate(self) -> None:
        super()._validate()
        self._leave_out_unflushed()

    def _leave_out_unflushed(self) -> None:
        """A writer whose flush failed (a full disk, a file size limit) names the rows each
        appended table had at its last flush that completed (status `rows_flushed`,
        trace/fallback.py). The rows past them came from the failed flush, which may have put
        some of their columns on disk and not others (a step row whose records read back as
        finite zeros): they are left out, and the ring and the summaries hold those steps. A
        status without the counts (an older writer) leaves out the step rows from the failed
        step on (`_step_arrays`)."""
        try:
            st = self.meta.get("status")
        except TraceFormatError:  # raised again where the status is read
            return
        if not isinstance(st, dict) or not st.get("writer_error"):
            return
        rows = st.get("rows_flushed")
        if not isinstance(rows, dict):
            at = st.get("writer_failed_at_step")
            if isinstance(at, int) and not isinstance(at, bool) and at >= 0:
                self._unflushed_from_step = at
            return
        for table, n in rows.items():
            if table in self._lengths and isinstance(n, int) and not isinstance(n, bool) \
                    and n >= 0:
                self._lengths[table] = min(self._lengths[table], n)

    # -- metadata ----------------------------------------------------------------------------
    @cached_property
    def meta(self) -> dict[str, Any]:
        """environment, capture_options, status (absent: writer never closed), outcome."""
        out: dict[str, Any] = {}
        if "meta" in self._lost:
            return out
        try:
            g = self._f.get("meta")
            keys = [k for k in schema.META_KEYS if k in g.attrs]
            raws = {k: g.attrs[k] for k in keys}
        except UNREADABLE_ERRORS as exc:
            self.unreadable.append(f"/meta attributes ({exc})")
            return out
        for key, raw in raws.items():
            out[key] = _parse_json(raw, f"{self.path}: /meta@{key}")
        st = out.get("status")
        if not (isinstance(st, dict) and st.get("state")):
            raw_st = self._raw_status()
            if raw_st is not None:
                out["status"] = raw_st
        if "environment" not in out:
            self.unreadable.append("/meta@environment is missing (every writer stores it)")
        return out

    def _raw_status(self) -> dict[str, Any] | None:
        """The status a writer whose HDF5 writes failed left in /status_raw (zero-padded
        JSON), when it holds one with a state."""
        import h5py

        ds = self._f.get(schema.STATUS_RAW)
        if not isinstance(ds, h5py.Dataset) or ds.ndim != 1 or ds.dtype != np.uint8 \
                or not 0 < ds.shape[0] <= 1 << 16:
            return None
        try:
            data = bytes(ds[:]).split(b"\0", 1)[0]
            st = _parse_json(data, f"{self.path}: /{schema.STATUS_RAW}") if data else None
        except (*UNREADABLE_ERRORS, TraceFormatError) as exc:
            self.unreadable.append(f"/{schema.STATUS_RAW} ({exc})")
            return None
        return st if isinstance(st, dict) and st.get("state") else None

    @cached_property
    def module_columns(self) -> dict[str, np.ndarray]:
        """The /modules table (name, type, kind, info) as object arrays of str, by module id;
        a kind that is not a module kind is noted in `unreadable`."""
        cols: dict[str, np.ndarray] = {}
        for col, _ in schema.MODULE_COLUMNS:
            ds = self._dataset(f"modules/{col}")
            if ds is None:
                raise TraceUnreadableError(f"{self.path}: /modules/{col} is unreadable")
            vals = read(ds, slice(None), self.path)
            arr = np.empty(len(vals), dtype=object)
            arr[:] = [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
                      for v in vals]
            cols[col] = frozen_view(arr)
        kinds = cols["kind"]
        odd = np.array([k not in MODULE_KINDS for k in kinds], dtype=bool)
        if odd.any():
            i = int(np.argmax(odd))
            self.unreadable.append(f"/modules/kind[{i}] is {kinds[i]!r:.40}, not a "
                                   f"module kind ({', '.join(sorted(MODULE_KINDS))})")
        return cols

    @property
    def module_names(self) -> np.ndarray:
        return self.module_columns["name"]

    @property
    def module_kinds(self) -> np.ndarray:
        return self.module_columns["kind"]

    @cached_property
    def modules(self) -> pd.DataFrame:
        import pandas as pd

        df = pd.DataFrame({k: list(v) for k, v in self.module_columns.items()})
        df.index.name = "module_id"
        return df

    def module_info(self, module_id: int) -> dict[str, Any]:
        raw = self.module_columns["info"][int(module_id)]
        return _parse_json(raw, f"{self.path}: /modules/info[{module_id}]") if raw else {}

    def module_name(self, module_id: int) -> str:
        if 0 <= int(module_id) < self.n_modules:
            return self.module_names[int(module_id)] or "(model output)"
        return f"<unknown module {module_id}>"

    # -- steps -------------------------------------------------------------------------------
    @cached_property
    def _step_arrays(self) -> dict[str, np.ndarray]:
        """The /steps table as far as it is readable, cut at the first row whose records,
        tokens or record health (NaN/Inf counts) cannot be read or point past the data."""
        raw, bad_row = self._read_prefix_table("steps", schema.STEP_COLUMNS)
        if bad_row is not None:
            self.unreadable.append(f"/steps rows from {bad_row} on")
        if self._unflushed_from_step >= 0:  # rows of the failed flush: possibly torn
            late = raw["step"] >= self._unflushed_from_step
            if late.any():
                cut = int(np.argmax(late))
                raw = {k: v[:cut] for k, v in raw.items()}
        # a lost /records keeps the summaries usable; their spans are checked for sanity only
        self._check_step_domains(raw)
        n_rec = self._records_limit()
        ok = valid_spans(raw["record_offset"], raw["record_count"], n_rec)
        ok &= valid_spans(raw["token_offset"], raw["token_count"],
                          self._lengths["tokens/input_ids"])
        if not ok.all():
            cut = int(np.argmin(ok))
            self.unreadable.append(f"/steps rows from {cut} on point past the data they index")
            raw = {k: v[:cut] for k, v in raw.items()}
        n = len(raw["step"])
        end = _span_end(raw)
        # every record column is read (and decompressed) once, so damage anywhere in /records
        # is seen; the NaN/Inf counts are kept for the cross-check with the summaries
        table, bad_rec = self._read_prefix_table("records", schema.RECORD_COLUMNS, stop=end)
        health = {k: table[k] for k in _HEALTH}
        if bad_rec is None and all(len(table[k]) == end for k in _KEEP):
            if end:  # ring-relative channel offsets, resolved once for the whole trace
                table["chan_offset"] = self._ring.resolve(table["chan_offset"], table["flags"],
                                                          table["step"], table["channels"])
            self._rec_cols = {k: frozen_view(table[k]) for k in _KEEP}
        del table
        self._health = health
        self.records_readable = len(health["nan_count"]) if bad_rec is None else bad_rec
        if bad_rec is not None:
            keep = (raw["record_offset"] + raw["record_count"]) <= bad_rec  # both >= 0 here
            cut = int(np.argmin(keep)) if not keep.all() else n
            self.unreadable.append(f"/records rows from {bad_rec} on (the records of step rows "
                                   f"from {cut} on; their per-step summaries remain)")
        neg = (health["nan_count"] < 0) | (health["inf_count"] < 0)
        if neg.any():
            self.unreadable.append(f"/records row {int(np.argmax(neg))} has a negative NaN/Inf "
                                   "count")
        return {k: frozen_view(v) for k, v in raw.items()}

    def _check_step_domains(self, raw: dict[str, np.ndarray]) -> None:
        """Counts are >= 0, 'first' indices are -1 (none) or >= 0, flags are 0 or 1: a value
        outside its domain is damage the format itself can show. `complete` is 0 or 1 before
        format 1.3 (2, a spilled step, came with it)."""
        for col, lo, hi in _STEP_DOMAINS:
            if col == "complete" and self.format_version < (1, 3):
                hi = schema.STEP_WHOLE
            v = raw[col]
            bad = (v < lo) | (v > hi) if hi is not None else (v < lo)
            if bad.any():
                i = int(np.argmax(bad))
                self.unreadable.append(f"/steps/{col}[{i}] holds {v[i]}, outside its domain")

    def nonfinite_record_steps(self) -> np.ndarray:
        """Steps (sorted, unique) holding any record with NaN or Inf, from a scan of every
        record's counts (independent of the per-step summaries)."""
        steps = self._step_arrays
        h = self._health
        end = min(self.records_end, len(h["nan_count"]))
        bad = (h["nan_count"][:end] > 0) | (h["inf_count"][:end] > 0)
        if not bad.any():
            return np.zeros(0, dtype=np.int64)
        rows = np.nonzero(bad)[0]
        idx = np.searchsorted(steps["record_offset"], rows, side="right") - 1
        return np.unique(steps["step"][idx[idx >= 0]].astype(np.int64))

    @cached_property
    def step_table(self) -> Table:
        """The readable /steps rows (see `_step_arrays`) as a `Table`, in file order."""
        return Table(self._step_arrays)

    @cached_property
    def steps(self) -> pd.DataFrame:
        import pandas as pd

        raw = self._step_arrays
        cols = {k: v for k, v in raw.items() if v.ndim == 1}
        df = pd.DataFrame(cols)
        df["logits_top5_ids"] = list(raw["logits_top5_ids"])
        df["logits_top5_values"] = list(raw["logits_top5_values"])
        return df

    @property
    def n_steps(self) -> int:
        return len(self._step_arrays["step"])

    def step_row(self, step: int) -> int:
        idx = np.nonzero(self._step_arrays["step"] == step)[0]
        if len(idx) == 0:
            raise TraceFormatError(f"{self.path}: no step {step} in this trace "
                                   f"({self.n_steps} steps recorded)")
        return int(idx[0])

    def input_ids(self, step: int) -> np.ndarray:
        r = self.step_row(step)
        lo, hi = checked_span(self._step_arrays["token_offset"][r],
                              self._step_arrays["token_count"][r],
                              self._lengths["tokens/input_ids"], f"{self.path}: step {step} tokens")
        return read(self._ds("tokens/input_ids"), slice(lo, hi), self.path)

    @cached_property
    def end(self) -> TraceEnd:
        status = self.meta.get("status")
        n = self.n_steps
        last = int(self._step_arrays["step"][-1]) if n else -1
        if self.cut_short:
            return TraceEnd(False, last, f"{self.cut_short}; the readable part ends after step "
                            f"{last} ({n} steps)")
        if isinstance(status, dict) and status.get("state"):
            state = str(status.get("state"))
            # SIGTERM is how a server or a pod is stopped: a normal end, noted
            sig = status.get("signal") if state == "complete" else (
                state[len("signal "):] if state == "signal SIGTERM" else None)
            if state == "complete" or sig:
                return TraceEnd(True, last, f"complete: {n} steps"
                                + (f" (stopped by {sig})" if sig else ""))
            return TraceEnd(True, last, f"run ended with {state}: "
                            f"{status.get('error', '')}".rstrip(": "))
        orphan = self._lengths["records"] - self.records_end
        summ = self.summary_table  # every step's summary outlives the appended detail
        if summ is not None and len(summ) and not orphan:
            last = max(last, int(summ["step_hi"][-1]))
        return TraceEnd(False, last, "truncated: the writer never closed the file (the run "
                        f"crashed or was killed); trace ends after step {last}"
                        + (f", {orphan} records of a later step are incomplete" if orphan else ""))

    # -- records -----------------------------------------------------------------------------
    def record_table(self, step: int | None = None, *, start: int | None = None,
                     stop: int | None = None) -> Table:
        """Records of one step (or a row range, or everything) as a `Table`: a `row` column
        (the record's row in /records), every record column, and `module` (its name)."""
        if step is not None:
            r = self.step_row(step)
            start, stop = checked_span(self._step_arrays["record_offset"][r],
                                       self._step_arrays["record_count"][r],
                                       self._records_limit(), f"{self.path}: step {step}")
        start = 0 if start is None else int(start)
        stop = self.records_end if stop is None else int(stop)
        if stop > self.records_readable:
            raise TraceUnreadableError(f"{self.path}: /records rows [{start}, {stop}) could not "
                                       f"be read (readable up to row {self.records_readable})")
        key = (start, stop)
        got = self._rec_tables.get(key)
        if got is not None:
            return got
        stop = max(start, min(stop, self._lengths["records"]))
        names = [c for c, _, _ in schema.RECORD_COLUMNS]
        data = self._record_slice(start, stop, names)
        mod = data["module_id"]
        if len(mod) and (int(mod.min()) < 0 or int(mod.max()) >= self.n_modules):
            raise TraceFormatError(f"{self.path}: /records/module_id out of range")
        cols = {"row": np.arange(start, start + len(mod), dtype=np.int64)}
        cols.update((k, frozen_view(data[k])) for k in names)
        cols["module"] = self.module_names[mod]
        table = Table(cols)
        if step is not None:  # a step's records are read by several parts of the analysis
            if len(self._rec_tables) >= _RECORD_TABLES_KEPT:
                self._rec_tables.pop(next(iter(self._rec_tables)))
            self._rec_tables[key] = table
        return table

    def records(self, step: int | None = None, *, start: int | None = None,
                stop: int | None = None) -> pd.DataFrame:
        """`record_table` as a pandas DataFrame (a fresh copy on each call)."""
        return self.record_table(step, start=start, stop=stop).to_frame()

    def record_columns(self, fields: list[str]) -> dict[str, np.ndarray]:
        """Selected record columns over the whole trace (e.g. for a module-by-step heatmap);
        read-only arrays, shared between callers."""
        n = self.records_end
        out = self._record_slice(0, n, list(fields))
        if n <= self.records_readable:  # kept: later calls read nothing
            for k, v in out.items():
                if k not in self._rec_cols and len(v) == n:
                    self._rec_cols[k] = frozen_view(v)
        return out

    @property
    def records_end(self) -> int:
        """One past the last record row any readable step points to."""
        return _span_end(self._step_arrays)

    def iter_steps(self) -> Iterator[int]:
        yield from (int(s) for s in self._step_arrays["step"])


def open_trace(path: str | os.PathLike[str]) -> Trace:
    """Open and validate a trace. Raises TraceFormatError (a QForensicsError) when unusable."""
    return Trace(path)
