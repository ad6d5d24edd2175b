"""What the analyzer finds in a trace: plain dataclasses, and their versioned JSON form.

These objects are the contract between `qforensics.analyze` (which builds them), the CLI (which
prints them), the HTML report and the replay command (which read them). The names and fields
here are stable; new fields are added at the end with defaults. `Findings.to_dict()` is the
JSON schema documented in docs/analyze-json.md: `{"schema": "qforensics.analyze", "version":
SCHEMA_VERSION, ...}`. Bump the major version when a key is renamed or removed; adding keys is a
minor change. The JSON is written by qforensics.jsondoc (its one non-finite policy: "nan",
"inf", "-inf" strings).

No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from qforensics.analyze.diagnosis import (
    Cause,
    Divergence,
    Evidence,
    NonfiniteLogits,
    ReferenceComparison,
)
from qforensics.jsondoc import SCHEMAS, document, jsonable

__all__ = [
    "DIFF_SCHEMA_NAME",
    "FAILED",
    "PASSED",
    "SCHEMA_NAME",
    "SCHEMA_VERSION",
    "SUSPECT",
    "Cause",
    "DiffFindings",
    "Divergence",
    "Evidence",
    "Findings",
    "FirstNonfinite",
    "Gap",
    "MultiRankFindings",
    "NonfiniteLogits",
    "OutlierChannel",
    "PersistentOutlier",
    "Precursor",
    "ReferenceComparison",
    "SchemeDamage",
    "SnapshotRef",
    "Spread",
    "TraceEndInfo",
    "TrendPoint",
    "UnsafeModules",
    "Verdict",
]

SCHEMA_NAME = "qforensics.analyze"
DIFF_SCHEMA_NAME = "qforensics.diff"
SCHEMA_VERSION = SCHEMAS[SCHEMA_NAME]

FAILED = "FAILED"
SUSPECT = "SUSPECT"
PASSED = "PASSED"
STATUSES = (FAILED, SUSPECT, PASSED)  # worst first


# -- verdict ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Verdict:
    """`status` is FAILED (non-finite values), SUSPECT (finite but broken-looking) or PASSED.

    `line` is the one-line summary printed first, e.g.
    ``FAILED | first non-finite at step 0, call 683: model.layers.11.mlp.down_proj produced NaN
    from finite input``.
    """

    status: str
    line: str

    @property
    def exit_code(self) -> int:
        return 0 if self.status == PASSED else 1


# -- first non-finite ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Gap:
    """The first non-finite value is already in a hooked call's input: an unhooked op between the
    last finite output (`last_finite_call`, None when no call before it in the step had an
    output) and that input produced it."""

    json_type: ClassVar[str] = "gap"  # tells it from a FirstNonfinite producer in the JSON
    last_finite_call: int | None
    last_finite_module: str | None
    first_bad_call: int
    first_bad_module: str
    description: str


@dataclass(frozen=True)
class Spread:
    """How far the non-finite values went from the first one to the end of the trace."""

    n_modules: int  # distinct modules with a non-finite output (or input) from then on
    n_modules_total: int  # modules in the trace
    n_steps: int  # steps with any non-finite record from the first bad step on
    n_steps_after: int  # steps from the first bad step to the end (inclusive)
    n_records: int  # non-finite records in the first bad step
    logits_nonfinite_steps: int  # steps whose logits held NaN/Inf


Producer = str | Gap


@dataclass(frozen=True)
class FirstNonfinite:
    """Where the first NaN/Inf (in call order) appears.

    `io`/`tensor` say which tensor of call `call_index` holds it first: "output" (then `producer`
    is the module name: it turned finite input into non-finite output) or "input" (then
    `producer` is a `Gap`: the value arrived from an unhooked op; the module only propagated it).
    """

    step: int
    call_index: int
    module: str
    module_kind: str
    io: int  # 0 input, 1 output
    tensor: str  # "input" | "output"
    slot: int
    kind: str  # "nan" | "inf" | "nan+inf"
    nan_count: int
    inf_count: int
    numel: int
    producer: Producer
    input_min: float | None  # finite range of the producer's input (None for a gap)
    input_max: float | None
    input_absmax: float | None
    spread: Spread
    record_row: int = -1
    t_start: float = float("nan")  # wall-clock start of the step (compares ranks)
    mutated: bool = False  # the record's tensor was modified in place before it was reduced

    @property
    def is_gap(self) -> bool:
        return isinstance(self.producer, Gap)

    @property
    def producer_module(self) -> str | None:
        return None if isinstance(self.producer, Gap) else self.producer


# -- outliers --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrendPoint:
    step: int
    absmax: float
    ratio: float = float("nan")  # to the module's median channel absmax at that step


@dataclass(frozen=True)
class OutlierChannel:
    """One channel (last-dim index) of one module's input that stands out at `step`.

    `limits` names what it exceeds: "ratio" (ratio_to_median >= the ratio threshold),
    "absolute" (absmax >= the absolute threshold), "fp8-e4m3" (> 448), "fp8-e5m2" (> 57344),
    "fp16" (> 65504). `token` is the record's peak token (argmax of its per-token absmax), a
    proxy for where the channel peaks (`token_is_peak_proxy` True); None when not stored.
    `first_step` is the earliest step read in which this channel stood out in this module;
    `trend` its absmax over the steps read up to `step`.
    """

    module: str
    step: int
    call_index: int
    io: int
    channel: int
    absmax: float
    ratio_to_median: float
    median_absmax: float
    channels_total: int
    token: int | None
    token_is_peak_proxy: bool
    first_step: int | None
    trend: list[TrendPoint]
    limits: list[str]


@dataclass(frozen=True)
class PersistentOutlier:
    """A hidden-dim index standing out (ratio threshold) in many modules' inputs at one step."""

    dim: int
    modules: int  # modules whose input has this dim standing out
    modules_checked: int  # modules of the same width checked
    max_absmax: float
    max_ratio: float
    examples: list[str]


# -- predicted quantization damage -----------------------------------------------------------------
@dataclass(frozen=True)
class SchemeDamage:
    """What one activation scheme would do to one linear module's INPUT (from channel ranges).

    `scale` is the scale the scheme would use (for group / per-token schemes: the largest one,
    the one of the peak token / group; `scale_min` the smallest). `channels_zeroed`: channels
    whose absmax is below half their scale, so every value rounds to 0. `overflow_count`:
    channels whose absmax is above the format's largest value (static FP8 scale only).
    `fraction` = channels_zeroed / channels_total. `unsafe` is True when fraction reaches the
    unsafe threshold or anything overflows.
    """

    module: str
    scheme: str  # e.g. "int4-per-tensor", "int8-g128", "fp8-e4m3", "fp8-e5m2-dynamic"
    scale: float
    scale_min: float
    channels_zeroed: int
    channels_total: int
    overflow_count: int
    fraction: float
    unsafe: bool
    line: str


@dataclass(frozen=True)
class UnsafeModules:
    """The modules that make one scheme unsafe, worst first."""

    scheme: str
    modules: list[SchemeDamage]
    n_unsafe: int
    n_modules: int
    line: str


# -- precursors / silent failures ------------------------------------------------------------------
@dataclass(frozen=True)
class Precursor:
    """A warning sign in the logits or the generated tokens.

    kind: "logits_growth", "entropy_collapse", "repeat_loop", "uniform_logits",
    "extreme_logits", "outcome", "nonfinite_logits". `silent` items (in a run without NaN/Inf)
    make the verdict SUSPECT; the others are precursors of a failure shown next to it.
    """

    kind: str
    step_from: int
    step_to: int
    value: float
    silent: bool
    line: str
    values: list[float] = field(default_factory=list)


# -- trace facts -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SnapshotRef:
    call_index: int
    step: int
    module: str
    reason: str
    names: list[str]


@dataclass(frozen=True)
class TraceEndInfo:
    complete: bool
    last_step: int
    reason: str


@dataclass(frozen=True)
class Incident:
    """One runtime-guard trip recorded in the trace's /incidents table (qforensics.guard):
    action is one of qforensics.trace.schema.INCIDENT_ACTIONS."""

    step: int
    call_index: int
    module: str
    action: str
    nan_count: int
    inf_count: int
    detail: str


@dataclass
class Findings:
    """Everything `analyze_trace` found in one trace (one rank)."""

    trace: str
    rank: int
    world_size: int
    n_steps: int
    n_modules: int
    end: TraceEndInfo
    environment: dict[str, Any]
    verdict: Verdict
    first_nonfinite: FirstNonfinite | None = None
    outliers: list[OutlierChannel] = field(default_factory=list)
    outlier_step: int | None = None
    persistent: list[PersistentOutlier] = field(default_factory=list)
    damage: list[SchemeDamage] = field(default_factory=list)
    unsafe: list[UnsafeModules] = field(default_factory=list)
    damage_step: int | None = None
    precursors: list[Precursor] = field(default_factory=list)
    snapshots: list[SnapshotRef] = field(default_factory=list)
    thresholds: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    incidents: list[Incident] = field(default_factory=list)  # runtime-guard trips, in order
    cause: Cause | None = None  # why the producer went non-finite (with a failure)
    nonfinite_logits: NonfiniteLogits | None = None
    evidence: list[Evidence] = field(default_factory=list)  # silent-failure evidence
    parameters: list[Any] = field(default_factory=list)  # flagged ParamHealth, worst first
    parameter_summary: dict[str, int] = field(default_factory=dict)  # counts over all checked
    tied: list[list[str]] = field(default_factory=list)  # parameter names sharing storage
    reference: ReferenceComparison | None = None
    thresholds_rationale: dict[str, str] = field(default_factory=dict)
    engine: Any = None  # analyze.engine.EngineFindings of a serving-engine (vLLM) trace
    coverage: dict[str, Any] | None = None  # analyze.coverage.Coverage.to_dict(): steps seen

    @property
    def status(self) -> str:
        return self.verdict.status

    @property
    def exit_code(self) -> int:
        return self.verdict.exit_code

    def to_dict(self) -> dict[str, Any]:
        return document(SCHEMA_NAME, jsonable(self))


@dataclass
class MultiRankFindings:
    """Several traces (one per rank) of one run; `earliest` indexes the earliest failure."""

    ranks: list[Findings]
    earliest: int | None  # index into ranks of the earliest FAILED one (by step, then call)
    verdict: Verdict

    @property
    def exit_code(self) -> int:
        return self.verdict.exit_code

    def to_dict(self) -> dict[str, Any]:
        return document(SCHEMA_NAME, {
            "multi_rank": True,
            "verdict": jsonable(self.verdict),
            "earliest": self.earliest,
            "ranks": [r.to_dict() for r in self.ranks],
        })


# -- diff ------------------------------------------------------------------------------------------
@dataclass
class DiffFindings:
    reference: str
    suspect: str
    verdict: Verdict
    n_aligned: int
    n_only_reference: int
    n_only_suspect: int
    steps_compared: list[int]
    first_jump: Divergence | None
    ranked: list[Divergence]
    thresholds: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return self.verdict.exit_code

    def to_dict(self) -> dict[str, Any]:
        return document(DIFF_SCHEMA_NAME, jsonable(self))
