"""What the capture side hands the trace writer: one `StepBatch` per step (plain numpy arrays,
offsets relative to the batch's own arrays), and the merge of consecutive batches into one
append. No h5py, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    # /param_watch rows (hooks/paramwatch.py): parameters first seen non-finite at this step
    params: np.ndarray = field(
        default_factory=lambda: np.zeros(0, schema.param_watch_dtype()))


def held_ranges(cmin: Any, cmax: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """Channel minima and maxima as arrays, copied out where they are still held elsewhere
    (compiled mode leaves a ring step's in the stats op's ring: hooks/ringranges.py, whose
    halves have `resolve`); None when they are gone."""
    r = getattr(cmin, "resolve", None)
    return (cmin, cmax) if r is None else r()


def resolve_channels(b: StepBatch) -> bool:
    """A batch's channel ranges as arrays (`held_ranges`): True when the batch holds them,
    False when they are gone (then it holds none)."""
    got = held_ranges(b.chan_min, b.chan_max)
    if got is None:
        b.chan_min = b.chan_max = np.zeros(0, np.float32)
        return False
    b.chan_min, b.chan_max = got
    return True


def rebase_channels(rec: np.ndarray, base: int) -> None:
    """Shift the absolute channel offsets of records by `base` (ring-relative ones stay)."""
    absolute = (rec["chan_offset"] >= 0) & ((rec["flags"] & schema.FLAG_RING) == 0)
    rec["chan_offset"] = np.where(absolute, rec["chan_offset"] + base, rec["chan_offset"])


def merge_batches(batches: list[StepBatch]) -> StepBatch:
    """Concatenate consecutive step batches, rebasing their relative offsets (each array once,
    offsets shifted with one vectorized pass, not a copy and a rebase per batch)."""
    def bases(lengths: list[int], counts: list[int]) -> np.ndarray:
        """Each batch's offset in the merged array, repeated once per row it rebases."""
        start = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)])
        return np.repeat(start.astype(np.int64), counts)

    n_rec = [len(b.records) for b in batches]
    n_steps = [len(b.steps) for b in batches]
    rec = np.concatenate([b.records for b in batches])  # a new array: the batches stay as they are
    chan = bases([len(b.chan_min) for b in batches], n_rec)
    absolute = (rec["chan_offset"] >= 0) & ((rec["flags"] & schema.FLAG_RING) == 0)
    rec["chan_offset"] = np.where(absolute, rec["chan_offset"] + chan, rec["chan_offset"])
    tok = bases([len(b.tok_absmax) for b in batches], n_rec)
    rec["tok_offset"] = np.where(rec["tok_offset"] >= 0, rec["tok_offset"] + tok, -1)
    steps = np.concatenate([b.steps for b in batches])
    rec_base = bases(n_rec, n_steps)
    steps["record_offset"] += rec_base
    steps["token_offset"] += bases([len(b.input_ids) for b in batches], n_steps)
    steps["first_nonfinite_record"] = np.where(steps["first_nonfinite_record"] >= 0,
                                               steps["first_nonfinite_record"] + rec_base, -1)
    snaps = np.concatenate([b.snapshots for b in batches])
    snaps["offset"] += bases([len(b.snapshot_bytes) for b in batches],
                             [len(b.snapshots) for b in batches])
    return StepBatch(
        steps=steps, records=rec,
        chan_min=np.concatenate([b.chan_min for b in batches]),
        chan_max=np.concatenate([b.chan_max for b in batches]),
        tok_absmax=np.concatenate([b.tok_absmax for b in batches]),
        input_ids=np.concatenate([b.input_ids for b in batches]),
        snapshots=snaps,
        snapshot_bytes=np.concatenate([b.snapshot_bytes for b in batches]),
        incidents=np.concatenate([b.incidents for b in batches]),
        engine={t: np.concatenate([b.engine[t] for b in batches if t in b.engine])
                for t in schema.ENGINE_TABLES if any(t in b.engine for b in batches)},
        promote=[p for b in batches for p in b.promote],
        triggers=np.concatenate([b.triggers for b in batches]),
        params=np.concatenate([b.params for b in batches]),
    )
