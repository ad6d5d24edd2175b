"""Step batches shaped like captured steps, for the byte-budget tests (no torch)."""

from __future__ import annotations

import numpy as np

from qforensics.trace import schema
from qforensics.trace.writer import StepBatch, TraceWriter

N_MOD = 40  # hooked modules + the root (the last)
MODULES = [{"name": f"layers.{i}.proj", "type": "Linear", "kind": "linear"}
           for i in range(N_MOD - 1)] + [{"name": "", "type": "Model", "kind": "root"}]


def writer(path, max_bytes: int, *, ring: int = 8, window: int = 4, **kw) -> TraceWriter:
    return TraceWriter(path, modules=MODULES, environment={"python": "3"},
                       capture_options={"trigger_window": window, "snapshot_budget": 1 << 20},
                       ring_slots=ring, ring_chunk=4096, max_bytes=max_bytes, **kw)


def batch(step: int, *, nan_module: int | None = None, width: int = 64, t0: float = 0.0,
          dt: float = 0.05, logit: float = 10.0, triggers: bool = True) -> StepBatch:
    """One decode step: each module one input and one output record of `width` channels (the
    ring's per-channel block), one token row; `nan_module`: that module's output holds a NaN
    (and so do the logits)."""
    n = 2 * N_MOD
    rec = np.zeros(n, schema.record_dtype())
    rec["step"] = step
    rec["call_index"] = step * N_MOD + np.arange(n) // 2
    rec["module_id"] = np.arange(n) // 2
    rec["io"] = np.arange(n) % 2
    rec["flags"] = schema.FLAG_RING
    rec["channels"] = width
    rec["numel"] = width
    rec["rows"] = 1
    rec["chan_offset"] = np.arange(n) * width
    rec["tok_offset"], rec["tok_count"] = np.arange(n), 1
    rec["min"], rec["max"], rec["absmax"] = -1.0, 1.0, 1.0
    st = np.zeros(1, schema.step_dtype())
    st["step"], st["t_start"], st["duration"] = step, t0 + step * dt, dt * 0.8
    st["complete"], st["record_count"], st["n_calls"] = 1, n, N_MOD
    st["first_call"] = step * N_MOD
    st["first_nonfinite_call"] = st["first_nonfinite_record"] = -1
    st["token_count"], st["has_logits"] = 1, 1
    st["logits_min"], st["logits_max"], st["logits_mean"] = -logit, logit, 0.5
    # a healthy decode's logits: a varying argmax, spread and entropy (the silent-failure rules)
    rng = np.random.default_rng(step)
    st["logits_std"], st["logits_entropy"] = 2.0 + rng.random(), 1.0 + rng.random()
    st["logits_argmax"] = rng.integers(100, 5000)
    st["logits_top5_ids"] = st["logits_argmax"] + np.arange(5)
    st["logits_top5_values"] = logit - np.arange(5, dtype=np.float32)
    trig = np.zeros(0, schema.trigger_dtype())
    if nan_module is not None:
        bad = np.nonzero(rec["module_id"] >= nan_module)[0]
        bad = bad[(rec["module_id"][bad] > nan_module) | (rec["io"][bad] == schema.IO_OUTPUT)]
        rec["nan_count"][bad] = 1
        st["n_nonfinite_records"] = len(bad)
        st["first_nonfinite_record"] = int(bad[0])
        st["first_nonfinite_call"] = int(rec["call_index"][bad[0]])
        st["logits_nan"] = 1
        if triggers:  # as the flight recorder marks it (channel_steps="auto")
            trig = np.zeros(1, schema.trigger_dtype())
            trig["step"], trig["kind"], trig["value"], trig["kept"] = step, b"nonfinite", 1.0, 1
    ch = np.tile(np.linspace(-1, 1, width, dtype=np.float32), n)
    return StepBatch(steps=st, records=rec, chan_min=ch - 1, chan_max=ch + 1,
                     tok_absmax=np.ones(n, np.float32), input_ids=np.array([step], np.int64),
                     ring=True, triggers=trig)


def engine_batch(**tables: np.ndarray) -> StepBatch:
    """An engine's tables of a step on their own, as vLLM's adapter submits them."""
    return StepBatch(steps=np.zeros(0, schema.step_dtype()),
                     records=np.zeros(0, schema.record_dtype()), chan_min=np.zeros(0),
                     chan_max=np.zeros(0), tok_absmax=np.zeros(0, np.float32),
                     input_ids=np.zeros(0, np.int64), engine=tables)


def write_run(w: TraceWriter, n: int, nan_at: set[int] = frozenset(), nan_module: int = 7,
              **kw) -> None:
    for s in range(n):
        w.submit(batch(s, nan_module=nan_module if s in nan_at else None, **kw))
        if s % 64 == 63:  # drains of a serving second's worth of steps, as in a real run
            w.flush()
    w.close()
