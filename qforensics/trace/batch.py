"""What the capture side hands the trace writer: one `StepBatch` per step (plain numpy arrays,
offsets relative to the batch's own arrays), and the merge of consecutive batches into one
append. No h5py, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from qforensics.trace import schema


@dataclass
class StepBatch:
    """Everything one step produced. Offsets inside are relative to this batch's own arrays."""

    steps: np.ndarray  # structured, schema.step_dtype(), usually one row
    records: np.ndarray  # structured, schema.record_dtype()
    chan_min: np.ndarray  # flat
    chan_max: np.ndarray
    tok_absmax: np.ndarray  # flat float32
    input_ids: np.ndarray  # flat int64
    snapshots: np.ndarray = field(default_factory=lambda: np.zeros(0, schema.snapshot_dtype()))
    snapshot_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    incidents: np.ndarray = field(default_factory=lambda: np.zeros(0, schema.incident_dtype()))
    # /engine/<table> rows (schema.ENGINE_TABLES); self-describing, nothing to rebase
    engine: dict[str, np.ndarray] = field(default_factory=dict)
    # 1.1: this step's channel block goes to the ring (its records carry FLAG_RING and offsets
    # relative to the block), earlier ring blocks to keep for good, and the triggers it crossed
    ring: bool = False
    promote: list[tuple[int, np.ndarray, np.ndarray]] = field(default_factory=list)
    triggers: np.ndarray = field(default_factory=lambda: np.zeros(0, schema.trigger_dtype()))


def rebase_channels(rec: np.ndarray, base: int) -> None:
    """Shift the absolute channel offsets of records by `base` (ring-relative ones stay)."""
    absolute = (rec["chan_offset"] >= 0) & ((rec["flags"] & schema.FLAG_RING) == 0)
    rec["chan_offset"] = np.where(absolute, rec["chan_offset"] + base, rec["chan_offset"])


def merge_batches(batches: list[StepBatch]) -> StepBatch:
    """Concatenate consecutive step batches, rebasing their relative offsets."""
    recs, steps, snaps = [], [], []
    chan = tok = ids = data = rec_base = 0
    for b in batches:
        r = b.records.copy()
        rebase_channels(r, chan)
        r["tok_offset"] = np.where(r["tok_offset"] >= 0, r["tok_offset"] + tok, -1)
        st = b.steps.copy()
        st["record_offset"] += rec_base
        st["token_offset"] += ids
        st["first_nonfinite_record"] = np.where(st["first_nonfinite_record"] >= 0,
                                                st["first_nonfinite_record"] + rec_base, -1)
        sn = b.snapshots.copy()
        sn["offset"] += data
        recs.append(r)
        steps.append(st)
        snaps.append(sn)
        chan += len(b.chan_min)
        tok += len(b.tok_absmax)
        ids += len(b.input_ids)
        data += len(b.snapshot_bytes)
        rec_base += len(r)
    return StepBatch(
        steps=np.concatenate(steps), records=np.concatenate(recs),
        chan_min=np.concatenate([b.chan_min for b in batches]),
        chan_max=np.concatenate([b.chan_max for b in batches]),
        tok_absmax=np.concatenate([b.tok_absmax for b in batches]),
        input_ids=np.concatenate([b.input_ids for b in batches]),
        snapshots=np.concatenate(snaps),
        snapshot_bytes=np.concatenate([b.snapshot_bytes for b in batches]),
        incidents=np.concatenate([b.incidents for b in batches]),
        engine={t: np.concatenate([b.engine[t] for b in batches if t in b.engine])
                for t in schema.ENGINE_TABLES if any(t in b.engine for b in batches)},
        promote=[p for b in batches for p in b.promote],
        triggers=np.concatenate([b.triggers for b in batches]),
    )
