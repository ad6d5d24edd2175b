"""The parts of the findings that say why: the cause of a failure, the silent-failure evidence,
what non-finite logits did to decoding, and the comparison with a reference trace (with the
record-by-record Divergence it ranks). Plain
dataclasses, re-exported by `qforensics.analyze.findings` (their JSON is part of
docs/analyze-json.md). No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Cause", "Divergence", "Evidence", "NonfiniteLogits", "ReferenceComparison"]


@dataclass(frozen=True)
class Evidence:
    """One sign, read from the trace alone, that a run's parameters, activations or output were
    damaged. `source` is "parameters", "activations" or "output"; `suspect` items make a run
    without NaN/Inf read SUSPECT. `value` is compared with `threshold` (the `thresholds` key
    `threshold_name`); `details` lists the modules / tensors / channels involved (capped)."""

    kind: str
    source: str
    suspect: bool
    line: str
    value: float
    threshold: float
    threshold_name: str
    modules: list[str] = field(default_factory=list)
    details: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Cause:
    """Why the producer went non-finite.

    kind: "corrupted_parameters" (its weight, scale or zero point holds NaN/Inf, or a scale is
    zero: `tensors` names each, with where the first bad value sits and any tied names),
    "activation_outlier" (an input channel beyond a format's range: `channels`, `format`,
    `limit`), "compute_overflow" (finite input and parameters, an Inf output in a 16-bit compute
    dtype: `limit` 65504 for fp16), "unhooked_op" (the value arrived from between two hooked
    calls), "undetermined" (none of these shows in the trace)."""

    kind: str
    line: str
    module: str
    tensors: list[dict[str, Any]] = field(default_factory=list)
    channels: list[int] = field(default_factory=list)
    format: str | None = None
    limit: float | None = None


@dataclass(frozen=True)
class NonfiniteLogits:
    """The first step whose logits hold NaN/Inf, what it did to decoding.

    `per_row` is exact when every non-finite entry lies in the vocab ids that have no finite
    value in any row (then each row holds `per_row` of them); otherwise it is None and
    `last_row_count` (the last position of batch row 0) is what is known per row. `vocab_ids`:
    ids with no finite logit in any row (first 32; `n_vocab_ids` all). `next_token`: the id
    the run actually fed back next (the next step's input), when recorded."""

    step: int
    rows: int
    vocab: int
    nan_count: int
    inf_count: int
    per_row: int | None
    last_row_count: int
    rows_without_finite: int
    vocab_ids: list[int]
    n_vocab_ids: int
    argmax: int
    next_token: int | None
    symptom: str


@dataclass(frozen=True)
class Divergence:
    """One record aligned by (module, step, io, slot) across a reference and a suspect trace.

    rel_* are |suspect - reference| / max(|reference|, eps) of the record statistics;
    `channel_div` the largest per-channel range difference relative to the reference absmax
    (None when either side lacks channel ranges); `sqnr_db` / `cosine` from snapshot tensors
    when both traces kept one for the call (else None). `score` is what is ranked; `jump` is the
    score minus the largest score of the records before it in call order.
    """

    module: str
    step: int
    io: int
    slot: int
    call_index: int  # in the reference trace
    suspect_call_index: int
    rel_absmax: float
    rel_std: float
    rel_mean: float
    channel_div: float | None
    sqnr_db: float | None
    cosine: float | None
    score: float
    jump: float
    nonfinite: bool  # the suspect record has NaN/Inf and the reference does not


@dataclass
class ReferenceComparison:
    """The run against a reference trace of the same prompt (`--reference`): the first module
    whose divergence jumps, the error per decoder layer, and whether it starts at a quantized
    layer."""

    reference: str
    status: str  # the diff's verdict status
    line: str
    first_diverging: Divergence | None
    per_layer: list[dict[str, Any]]
    starts_at: str  # "quantized" | "after_quantized" | "unquantized" | "none"
    notes: list[str] = field(default_factory=list)
