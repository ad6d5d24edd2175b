"""Host-side assembly: one StepBatch per step for the writer, from the parts of the step that
hooks/graphread.py built out of the stats op's ring (record rows, channel and token arrays).
Numpy only."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from qforensics.formats import FP16_MAX
from qforensics.trace import schema
from qforensics.trace.writer import StepBatch

def _joined(parts: list[np.ndarray], empty: Any) -> np.ndarray:
    """The parts as one array (the part itself when there is one: treat as read-only)."""
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros(0, empty)


def build_batch(parts: list[dict[str, Any]], *, step: int, t0: float,
                t_end: float | None = None, first_call: int,
                next_call: int, logits_row: np.ndarray | None, ids: np.ndarray, complete: bool,
                snaps: np.ndarray, data: np.ndarray, incidents: np.ndarray,
                channel_dtype: str, detail: bool = True) -> StepBatch:
    """The step's parts (one per reduction) -> one StepBatch: records in call order, offsets
    rebased, the step row with its logits summary. `t_end`: when the step ended, for a step
    emitted later (default: now). `detail` False: a compiled step whose ring detail was
    spilled (hooks/graphlate.py), `complete` 2."""
    recs = []
    cmins, cmaxs, toks = [], [], []
    chan_base = tok_base = 0
    for part in parts:
        rec = part["records"]
        rec["chan_offset"] = np.where(rec["chan_offset"] >= 0, rec["chan_offset"] + chan_base, -1)
        rec["tok_offset"] = np.where(rec["tok_offset"] >= 0, rec["tok_offset"] + tok_base, -1)
        chan_base += len(part["cmin"])
        tok_base += len(part["tok"])
        recs.append(rec)
        cmins.append(part["cmin"])
        cmaxs.append(part["cmax"])
        toks.append(part["tok"])
    rec = _joined(recs, schema.record_dtype())
    ci = rec["call_index"]
    if len(ci) > 1 and not (ci[1:] >= ci[:-1]).all():
        rec = rec[np.argsort(ci, kind="stable")]
    st = np.zeros(1, dtype=schema.step_dtype())
    s = st[0]
    s["step"] = step
    s["t_start"] = t0
    s["duration"] = (time.time() if t_end is None else t_end) - t0
    s["complete"] = (schema.STEP_WHOLE if detail else schema.STEP_SPILLED) if complete else (
        schema.STEP_RAISED)
    s["record_offset"] = 0
    s["record_count"] = len(rec)
    s["first_call"] = first_call if next_call > first_call else -1
    s["n_calls"] = next_call - first_call
    bad = (rec["nan_count"] + rec["inf_count"]) > 0
    s["n_nonfinite_records"] = int(bad.sum())
    s["first_nonfinite_record"] = int(np.argmax(bad)) if bad.any() else -1
    out_bad = bad & (rec["io"] == schema.IO_OUTPUT)
    s["first_nonfinite_call"] = int(rec["call_index"][np.argmax(out_bad)]) if out_bad.any() else -1
    s["token_offset"] = 0
    s["token_count"] = len(ids)
    if logits_row is not None:
        s["has_logits"] = 1
        if not logits_row[0] <= logits_row[1]:  # no finite logit at all
            logits_row = logits_row.copy()
            logits_row[[0, 1, 2, 3, 4]] = np.nan
        (s["logits_min"], s["logits_max"], s["logits_mean"], s["logits_std"],
         s["logits_entropy"]) = logits_row[:5]
        s["logits_nan"], s["logits_inf"], s["logits_argmax"] = (
            int(logits_row[5]), int(logits_row[6]), int(logits_row[7]))
        s["logits_top5_ids"] = logits_row[8:13].astype(np.int64)
        s["logits_top5_values"] = logits_row[13:18]
    else:
        s["logits_argmax"] = -1
        s["logits_top5_ids"] = -1
        for f in ("logits_min", "logits_max", "logits_mean", "logits_std", "logits_entropy"):
            s[f] = np.nan
        s["logits_top5_values"] = np.nan
    chan_min = _joined(cmins, np.float64)
    same = len(cmins) == len(cmaxs) and all(a is b for a, b in zip(cmins, cmaxs))
    batch = StepBatch(
        steps=st, records=rec,
        chan_min=chan_min, chan_max=chan_min if same else _joined(cmaxs, np.float64),
        tok_absmax=_joined(toks, np.float32),
        input_ids=ids, snapshots=snaps, snapshot_bytes=data, incidents=incidents,
    )
    if channel_dtype == "float16":
        batch.chan_min = to_f16(batch.chan_min)
        batch.chan_max = to_f16(batch.chan_max)
    return batch


def to_f16(a: np.ndarray) -> np.ndarray:
    """float16 without turning large finite values into inf (clip finite values to 65504)."""
    lim = np.float64(FP16_MAX)
    a = np.asarray(a, np.float64)
    return np.where(np.isfinite(a), np.clip(a, -lim, lim), a).astype(np.float16)
