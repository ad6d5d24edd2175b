"""The trace schema: every group, dataset, column and dtype of a qforensics trace.

This module and docs/trace-format.md are the only places the layout is defined; the writer and
the reader both take it from here. No torch import.
"""

from __future__ import annotations

import functools

import numpy as np

FORMAT_NAME = "qforensics-trace"
FORMAT_VERSION = (1, 3)  # (major, minor): a reader refuses a newer major
FORMAT_VERSION_STR = f"{FORMAT_VERSION[0]}.{FORMAT_VERSION[1]}"

# Record roles
IO_INPUT = 0
IO_OUTPUT = 1

# Record flags (bit field)
FLAG_MUTATED = 1  # the tensor was modified in place between the call and its reduction
FLAG_DEGRADED = 2  # stats could not be computed for this tensor (capture degraded)
FLAG_META = 4  # meta / fake tensor: shape only, no values
FLAG_NONFLOAT = 8  # integer or bool tensor, stats are of its values cast to float
FLAG_RING = 16  # (1.1) chan_offset is relative to the step's block in the ring (see RING_*)

# Channel keeping (1.1): per-channel ranges of a step are kept permanently in /channels (the
# prefill, a triggered step and the W steps before it, steps chosen by channel_steps) or go to
# the fixed-size circular region /ring (the last K steps); promoted ring blocks are copied into
# /channels and listed in /channels/promoted.
RING_DATASETS = ("ring/min", "ring/max")  # 2-D (K slots, slot capacity), channel dtype
RING_INDEX = ("ring/step", "ring/count")  # 1-D (K,) i8: step held by each slot (-1), its length

DTYPE_CODES: dict[str, int] = {
    "float32": 0,
    "float16": 1,
    "bfloat16": 2,
    "float64": 3,
    "float8_e4m3fn": 4,
    "float8_e5m2": 5,
    "int": 6,
    "bool": 7,
    "other": 8,
}
DTYPE_NAMES = {v: k for k, v in DTYPE_CODES.items()}

# /steps `complete`: the forward returned (1); it raised, or capture closed mid-step (0); it
# returned, but its per-module detail was given up before it was read (2, format 1.3: compiled
# mode's ring overflowed and the model's thread went on instead of waiting; only steps the
# op's first-failure word was clear through, so their NaN/Inf check is kept: no records)
STEP_RAISED, STEP_WHOLE, STEP_SPILLED = 0, 1, 2

# /steps: one row per step. (name, numpy dtype, trailing shape)
STEP_COLUMNS: list[tuple[str, str, tuple[int, ...]]] = [
    ("step", "i4", ()),
    ("t_start", "f8", ()),  # unix time the step began
    ("duration", "f8", ()),  # seconds, wall clock, including the reduction
    ("complete", "i1", ()),  # STEP_WHOLE, STEP_SPILLED, STEP_RAISED (above)
    ("record_offset", "i8", ()),  # first row of this step in /records
    ("record_count", "i8", ()),
    ("first_call", "i8", ()),  # call_index of the first call in this step (-1: none)
    ("n_calls", "i8", ()),
    ("first_nonfinite_call", "i8", ()),  # first call whose output had NaN/Inf (-1: none)
    ("first_nonfinite_record", "i8", ()),  # first record row (input or output) with NaN/Inf (-1)
    ("n_nonfinite_records", "i8", ()),
    ("token_offset", "i8", ()),  # into /tokens/input_ids
    ("token_count", "i8", ()),
    ("has_logits", "i1", ()),
    ("logits_min", "f4", ()),
    ("logits_max", "f4", ()),
    ("logits_mean", "f4", ()),
    ("logits_std", "f4", ()),
    ("logits_entropy", "f4", ()),
    ("logits_nan", "i8", ()),
    ("logits_inf", "i8", ()),
    ("logits_argmax", "i8", ()),
    ("logits_top5_ids", "i8", (5,)),
    ("logits_top5_values", "f4", (5,)),
]

# /records: one row per recorded tensor of a call (its inputs and outputs), in call order.
RECORD_COLUMNS: list[tuple[str, str, tuple[int, ...]]] = [
    ("call_index", "i8", ()),
    ("step", "i4", ()),
    ("module_id", "i4", ()),
    ("io", "i1", ()),  # IO_INPUT / IO_OUTPUT
    ("slot", "i1", ()),  # position among the call's recorded inputs (or outputs)
    ("dtype", "i1", ()),  # DTYPE_CODES
    ("flags", "i1", ()),
    ("numel", "i8", ()),
    ("rows", "i8", ()),  # numel / channels: tokens (batch * sequence) for activations
    ("channels", "i4", ()),  # size of the last dimension
    ("min", "f4", ()),  # over finite values; NaN when there is none
    ("max", "f4", ()),
    ("mean", "f4", ()),
    ("std", "f4", ()),
    ("absmax", "f4", ()),
    ("nan_count", "i8", ()),
    ("inf_count", "i8", ()),
    ("chan_offset", "i8", ()),  # into /channels/min and /channels/max (-1: not stored)
    ("tok_offset", "i8", ()),  # into /tokens/absmax (-1: not stored)
    ("tok_count", "i8", ()),
]

# /snapshots/index: one row per kept tensor; bytes live in /snapshots/data.
SNAPSHOT_COLUMNS: list[tuple[str, str, tuple[int, ...]]] = [
    ("call_index", "i8", ()),
    ("step", "i4", ()),
    ("module_id", "i4", ()),
    ("reason", "S32", ()),
    ("name", "S32", ()),
    ("dtype", "S16", ()),
    ("shape", "S96", ()),  # JSON list of ints
    ("offset", "i8", ()),
    ("nbytes", "i8", ()),
    ("truncated", "i1", ()),
]

# /incidents: one row per runtime-guard trip (qforensics.guard), written with its step.
INCIDENT_COLUMNS: list[tuple[str, str, tuple[int, ...]]] = [
    ("step", "i4", ()),
    ("call_index", "i8", ()),  # the call that tripped (-1: the logits / step level)
    ("module_id", "i4", ()),  # -1 when the module is not hooked by capture
    ("module", "S128", ()),
    ("action", "S24", ()),  # fallback | breaker_open | breaker_fallback | sanitize_logits |
    #                         no_rollback | vLLM: dequantized | request_repaired |
    #                         request_sanitized | guard_off
    ("nan_count", "i8", ()),
    ("inf_count", "i8", ()),
    ("detail", "S160", ()),
]
INCIDENT_ACTIONS = ("fallback", "breaker_open", "breaker_fallback", "sanitize_logits",
                    "no_rollback", "dequantized", "request_repaired", "request_sanitized",
                    "guard_off")

# /engine/*: what a serving engine's step means (vLLM). Tables of self-describing rows (no
# offsets), all empty for a plain HF run; a reader tolerates their absence (older 1.0 files).
ENGINE_STEP_COLUMNS: list[tuple[str, str, tuple[int, ...]]] = [
    ("step", "i4", ()),
    ("warmup", "i1", ()),  # 1: a warm-up / profile / dummy forward, not driven by a request
    ("n_rows", "i8", ()),  # token rows in this forward
    ("n_requests", "i4", ()),
]
ENGINE_ROW_COLUMNS: list[tuple[str, str, tuple[int, ...]]] = [
    ("step", "i4", ()),
    ("row", "i8", ()),  # token row in the step's flattened batch
    ("request", "i4", ()),  # index into /engine/requests (-1: padding or unknown)
    ("position", "i8", ()),  # the token's position in its request's sequence
    ("phase", "i1", ()),  # ENGINE_PHASES
]
ENGINE_REQUEST_COLUMNS: list[tuple[str, str, tuple[int, ...]]] = [
    ("request", "i4", ()),
    ("request_id", "S64", ()),  # the engine's id for it (truncated to 64 bytes)
    ("prompt_tokens", "i8", ()),
    ("first_step", "i4", ()),
]
ENGINE_SAMPLED_COLUMNS: list[tuple[str, str, tuple[int, ...]]] = [
    ("step", "i4", ()),
    ("request", "i4", ()),
    ("token", "i8", ()),  # the token the engine sampled for this request from this step's logits
]
# /engine/hits (1.2): where each request first held NaN/Inf, one row a request, written by the
# writer at that step (trace/hits.py) from the room the budget keeps for the requests table, so
# it outlives the step's full detail.
ENGINE_HIT_COLUMNS: list[tuple[str, str, tuple[int, ...]]] = [
    ("step", "i4", ()),
    ("request", "i4", ()),  # index into /engine/requests
    ("position", "i8", ()),  # its first bad position at its first bad op (-1: not known)
    ("length", "i8", ()),  # its sequence length after that step's tokens (-1: not known)
    ("phase", "i1", ()),  # ENGINE_PHASES of its rows in that step (-1: mixed or unknown)
    ("rows", "i4", ()),  # its token rows holding NaN/Inf at that op (0: its logits row only)
    ("logits", "i1", ()),  # 1: its row of the logits is non-finite
    ("token", "i8", ()),  # the input token id at `position` (-1: not recorded)
    ("call_index", "i8", ()),  # its first bad op (-1: only the row flags say it is bad)
    ("module_id", "i4", ()),  # that op's module (-1: not known)
    ("earlier", "i4", ()),  # other requests bad at an earlier op (or at it, bad before): 0 =
    #                         on its own
    ("same_op", "i4", ()),  # other requests first bad at the same op of that forward
]
# /engine/hits_checked (1.2): i8 [3], written in place: non-finite steps (warm-ups left out) the
# writer saw, how many of them it scanned for /engine/hits (their token rows came), and hit rows
# it dropped for want of room. analyze counts a scanned step as read: every request bad there
# has its row, or was bad before.
HITS_CHECKED = "engine/hits_checked"
ENGINE_TABLES: dict[str, list[tuple[str, str, tuple[int, ...]]]] = {
    "steps": ENGINE_STEP_COLUMNS, "rows": ENGINE_ROW_COLUMNS, "hits": ENGINE_HIT_COLUMNS,
    "requests": ENGINE_REQUEST_COLUMNS, "sampled": ENGINE_SAMPLED_COLUMNS,
}
ENGINE_PHASES = {0: "prefill", 1: "decode", -1: "unknown"}
# Engine runs: extra output records of the root module at the logits call, shape [rows, 1], 1.0
# where that row of the logits (one per request) / of the model's final hidden states (one per
# token row) holds a NaN/Inf; read through their per-token absmax.
ENGINE_ROW_FLAG_SLOTS = {"logits": 1, "hidden": 2}
# /channels/promoted (1.1): ring blocks copied into /channels when a trigger fired after them.
PROMOTED_COLUMNS: list[tuple[str, str, tuple[int, ...]]] = [
    ("step", "i8", ()),
    ("offset", "i8", ()),  # into /channels/min and /channels/max
    ("count", "i8", ()),
]

# /triggers (1.1): steps that crossed a trigger; their channels (and the W steps' before) kept.
TRIGGER_COLUMNS: list[tuple[str, str, tuple[int, ...]]] = [
    ("step", "i8", ()),
    ("kind", "S16", ()),  # nonfinite | outlier_growth | logits
    ("value", "f8", ()),  # the statistic that crossed (count, growth factor, logits absmax)
    ("reference", "f8", ()),  # what it was compared with (NaN when not applicable)
    ("kept", "i1", ()),  # 1: channels kept; 0: past the limit of triggered steps kept
]
TRIGGER_KINDS = ("nonfinite", "outlier_growth", "logits")

SNAPSHOT_REASONS = ("first_nonfinite_output", "first_outlier")
# dtypes a snapshot may hold (numpy names, little endian)
SNAPSHOT_DTYPES = ("float32", "float16", "float64", "int32", "int64", "uint8", "int8", "bool")

# flat arrays: path -> numpy dtype (channels: float32 or float16, chosen at capture)
FLAT_ARRAYS: dict[str, str] = {
    "channels/min": "f4",
    "channels/max": "f4",
    "tokens/absmax": "f4",
    "tokens/input_ids": "i8",
    "snapshots/data": "u1",
}

# /modules: written once when capture attaches
MODULE_COLUMNS: list[tuple[str, str]] = [
    ("name", "str"),
    ("type", "str"),
    ("kind", "str"),  # linear | quantized_linear | block | root
    ("info", "str"),  # JSON: params, quant, health
]

# /limits (1.1): i8 [2]: the max_bytes cap the writer ran with (0: none) and the step at which it
# was reached (-1: never). Reaching it stops every append; the ring keeps turning in place.
LIMITS_DATASET = "limits"

# /summary (1.2): every step's summary, never dropped, in a fixed number of rows written in
# place. Row i holds the steps [i * resolution, (i + 1) * resolution); when a step would need a
# row past the capacity, adjacent pairs are consolidated (min of mins, max of maxes, sums and
# counts) and the resolution doubles, round-robin-database style.
SUMMARY_BLOCKS = "summary/blocks"  # compound (capacity,), SUMMARY_COLUMNS
SUMMARY_STATE = "summary/state"  # i8 [4]: resolution, rows used, steps seen, capacity
SUMMARY_COLUMNS: list[tuple[str, str, tuple[int, ...]]] = [
    ("step_lo", "i8", ()),  # first step in the block (-1: empty row)
    ("step_hi", "i8", ()),  # last step in the block
    ("count", "i8", ()),  # steps summarized (engine warm-ups included)
    ("t_first", "f8", ()),  # t_start of the first step
    ("t_last", "f8", ()),  # t_start + duration of the last step
    ("duration_max", "f8", ()),
    ("logits_min", "f4", ()),  # min over the block's steps (finite values; NaN: none)
    ("logits_max", "f4", ()),
    ("logits_mean_sum", "f8", ()),  # sum of the steps' logits_mean (finite ones)
    ("logits_steps", "i8", ()),  # steps contributing to logits_mean_sum
    ("logits_nan", "i8", ()),  # sums of the steps' counts
    ("logits_inf", "i8", ()),
    ("nonfinite_steps", "i8", ()),  # steps (not warm-ups) with NaN/Inf in records or logits
    ("first_nonfinite_step", "i8", ()),  # first such step in the block (-1)
    ("first_nonfinite_call", "i8", ()),  # its first_nonfinite_call (-1: only in logits/inputs)
    ("nonfinite_records", "i8", ()),  # sum of n_nonfinite_records
    ("incomplete", "i8", ()),  # steps whose forward raised
    ("warmup", "i8", ()),  # engine warm-up / profile forwards
    ("bad_requests", "i8", ()),  # sum over steps of requests whose logits row held NaN/Inf
]

# Ring detail (1.2): once appending of full detail stops (max_bytes), every step's step row,
# records and per-token maxima also go to its ring slot (next to its channel block), so the
# last K steps keep their full detail. Record offsets in a slot are relative to the slot.
RING_STEPS = "ring/steps"  # compound (K,), STEP_COLUMNS
RING_RECORDS = "ring/records"  # compound (K, R), RECORD_COLUMNS
RING_TOKENS = "ring/tokens"  # f4 (K, T)
RING_DETAIL = "ring/detail"  # i8 (K, 2): records and token values the slot holds (0: none)
# u1 (16384,), contiguous: the closing status as JSON (zero-padded), written as raw bytes when
# HDF5's writes failed (a full disk) and /meta@status could not be sealed (trace/fallback.py)
STATUS_RAW = "status_raw"

# /param_watch (1.2 revision): parameters found holding NaN/Inf during the run (hooks/
# paramwatch.py), one row per tensor, at the first check that saw it so: the checks run every
# `param_watch` steps, at the end of a step with a non-finite record or logits, and at close.
# A reader tolerates its absence (older traces: parameters checked at attach only).
PARAM_WATCH_COLUMNS: list[tuple[str, str, tuple[int, ...]]] = [
    ("step", "i4", ()),  # the step at whose end the check first saw it non-finite
    ("last_finite", "i4", ()),  # the last check that saw it finite (-1: only at attach)
    ("module_id", "i4", ()),  # its module's row in /modules (-1: a module capture does not hook)
    ("module", "S128", ()),
    ("param", "S32", ()),  # the tensor's name in its module: weight | scales | weight_scale ...
    ("trigger", "S16", ()),  # PARAM_WATCH_TRIGGERS: what ran the check
    ("numel", "i8", ()),
    ("nan", "i8", ()),
    ("inf", "i8", ()),
    ("n_rows", "i8", ()),  # rows (dim 0) holding NaN/Inf (a 1-D tensor: its bad elements)
    ("rows", "i8", (8,)),  # the first of them, ascending (-1: none)
    ("col", "i8", ()),  # column (last dim) of the first bad value (-1: a 1-D tensor)
    ("group", "i8", ()),  # its quantization group along the input dim (-1: none known)
]
PARAM_WATCH_TRIGGERS = ("interval", "nonfinite", "close")

# /pinned (1.2): the first non-finite step and the first step of each trigger kind, with the W
# steps before it, kept in full detail in space reserved up front; later ones while room remains.
PINNED_COLUMNS: list[tuple[str, str, tuple[int, ...]]] = [
    ("step", "i8", ()),
    ("kind", "S16", ()),  # TRIGGER_KINDS
    ("window_lo", "i8", ()),  # first step of the window kept with it
    ("kept", "i1", ()),  # 1: in /steps and /records; 0: no room left (counted only)
]

META_KEYS = ("environment", "capture_options", "status", "outcome")


@functools.cache  # np.dtype is immutable: built once, shared
def step_dtype() -> np.dtype:
    return np.dtype([(n, t, s) for n, t, s in STEP_COLUMNS])


@functools.cache  # np.dtype is immutable: built once, shared
def record_dtype() -> np.dtype:
    return np.dtype([(n, t, s) for n, t, s in RECORD_COLUMNS])


@functools.cache  # np.dtype is immutable: built once, shared
def incident_dtype() -> np.dtype:
    return np.dtype([(n, t, s) for n, t, s in INCIDENT_COLUMNS])


@functools.cache  # np.dtype is immutable: built once, shared
def summary_dtype() -> np.dtype:
    return columns_dtype("summary")


def pinned_dtype() -> np.dtype:
    return columns_dtype("pinned")


@functools.cache
def columns_dtype(table: str) -> np.dtype:
    """The structured dtype of a 1.2 table's columns ("summary", "pinned")."""
    return np.dtype([(n, t, s) for n, t, s in {"summary": SUMMARY_COLUMNS,
                                               "pinned": PINNED_COLUMNS}[table]])


@functools.cache  # np.dtype is immutable: built once, shared
def param_watch_dtype() -> np.dtype:
    return np.dtype([(n, t, s) for n, t, s in PARAM_WATCH_COLUMNS])


@functools.cache  # np.dtype is immutable: built once, shared
def trigger_dtype() -> np.dtype:
    return np.dtype([(n, t, s) for n, t, s in TRIGGER_COLUMNS])


@functools.cache  # np.dtype is immutable: built once, shared
def snapshot_dtype() -> np.dtype:
    return np.dtype([(n, t, s) for n, t, s in SNAPSHOT_COLUMNS])


@functools.cache  # np.dtype is immutable: built once, shared
def engine_dtype(table: str) -> np.dtype:
    return np.dtype([(n, t, s) for n, t, s in ENGINE_TABLES[table]])
