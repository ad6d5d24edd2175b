"""The flight-recorder policy: which steps keep their per-channel ranges for good.

Scalars, per-token maxima and logits are kept for every step. Per-channel ranges (most of a
trace's bytes) are kept for good only for:
- the prefill (step 0, or any step with more than one input token that is not the previous
  step's input again with one new token: a loop without a KV cache, or with a static-shape
  buffer, re-feeds its whole sequence every step, and those steps are decodes; an engine
  adapter says which steps are prefills and which are warm-up forwards, see `apply`);
- a step that crosses a trigger, together with the `window` steps before it: non-finite values
  (the first such step always; then at most `limit`), outlier growth (the largest GEMM-input
  absmax of the step beyond `growth` x the largest of the last `slots` steps) and a logits
  anomaly (the same test on the logits' absmax), at most `limit` steps of each kind; the
  growth tests compare steps that are not prefills (a prefill is kept anyway);
- every other step goes to a rolling window of the last `slots` steps, held here in memory (to
  promote it when a trigger fires) and by the writer in a fixed-size circular region of the file
  (so a kill -9 keeps the last window). In compiled mode "held" means left in the stats op's
  ring until needed (hooks/ringranges.py): this class copies out what it keeps or promotes,
  and resolves every other ring step `slots + 1` steps later (`LazyTracker`).

Host-side numpy on a handful of numbers per step; nothing here touches a device.
"""

from __future__ import annotations

import collections
import math
from typing import Callable, Iterable

import numpy as np

from qforensics.hooks.ringranges import LazyTracker, materialize
from qforensics.trace import schema
from qforensics.trace.badstep import step_is_bad
from qforensics.trace.batch import held_ranges
from qforensics.trace.writer import StepBatch

def parse_steps(spec: str | Iterable[int] | Callable[[int], bool] | None) -> Callable[[int], bool]:
    """channel_steps: None/"auto"/"all", "none", "0-3,8,16" style ranges, an iterable, or a
    callable. "auto" reduces channels at every step; the flight recorder decides what stays."""
    if spec is None or spec in ("all", "auto"):
        return lambda s: True
    if spec == "none":
        return lambda s: False
    if callable(spec):
        return spec
    if isinstance(spec, str):
        chosen: set[int] = set()
        open_from: int | None = None
        for part in spec.split(","):
            part = part.strip()
            if not part:
                continue
            if part.endswith("-"):
                open_from = int(part[:-1])
            elif "-" in part:
                a, b = part.split("-", 1)
                chosen.update(range(int(a), int(b) + 1))
            else:
                chosen.add(int(part))
        return lambda s: s in chosen or (open_from is not None and s >= open_from)
    chosen = {int(s) for s in spec}
    return lambda s: s in chosen


_MIN_HISTORY = 4  # steps of history before a growth trigger may fire


class FlightRecorder:
    def __init__(self, *, slots: int, window: int, limit: int, growth: float,
                 gemm_ids: np.ndarray) -> None:
        self.slots = max(1, int(slots))
        self.window = max(0, min(int(window), self.slots))
        self.limit = max(0, int(limit))
        self.growth = float(growth)
        # module id -> is a GEMM (a look-up, not np.isin every step); the last slot, False,
        # answers for every id past the GEMMs' (take's mode="clip")
        ids = np.asarray(gemm_ids, np.int64)
        self._is_gemm = np.zeros(int(ids.max()) + 2 if len(ids) else 1, bool)
        self._is_gemm[ids] = True
        self._memory: collections.deque = collections.deque(maxlen=self.slots)
        self._outliers: collections.deque = collections.deque(maxlen=self.slots)
        self._logits: collections.deque = collections.deque(maxlen=self.slots)
        self._kept = collections.Counter()
        self._seen_nonfinite = False
        self._prev_ids: np.ndarray | None = None  # the last step's input ids (`_refeeds`)
        # compiled mode's ring steps whose channel ranges are still in the op's ring
        self.lazy = LazyTracker(horizon=self.slots + 1, file_slots=self.slots)

    def apply(self, batch: StepBatch, *, prefill: bool | None = None,
              warmup: bool = False) -> None:
        """Decide where this step's channel block goes; mark the batch accordingly.

        An engine adapter may say what the step is: `prefill` (the step computes prompt
        tokens; otherwise a step with more than one input token counts as a prefill, which is
        right for `generate` but not for a serving engine, whose decode steps carry one row per
        request) and `warmup` (a warm-up / profile forward on dummy data: it goes to the ring,
        never triggers and never enters the histories the growth triggers compare with)."""
        if len(batch.steps) != 1:
            materialize(batch)
            return
        s = batch.steps[0]
        step = int(s["step"])
        rec = batch.records
        self.lazy.advance(step)  # before this step is noted: a replacement already submitted
        if warmup:
            keep = False
        elif prefill is None:
            keep = step == 0 or (int(s["token_count"]) > 1
                                 and not self._refeeds(np.asarray(batch.input_ids)))
            self._prev_ids = np.asarray(batch.input_ids)
        else:
            keep = bool(prefill)
        # a prefill is kept anyway, and its maxima (many tokens, the first positions' large
        # activations) are no trend of the decode steps: it neither trips nor feeds the growth
        # triggers, only the non-finite one
        triggers = [] if warmup else self._triggers(s, rec, growth=not keep)
        if triggers:
            # the first non-finite step is always kept; beyond it each kind has `limit` steps
            first_bad = triggers[0][0] == "nonfinite" and not self._seen_nonfinite
            self._seen_nonfinite |= triggers[0][0] == "nonfinite"
            kept = first_bad or any(self._kept[k] < self.limit for k, _, _ in triggers)
            for k, _, _ in triggers:
                self._kept[k] += 1
            rows = np.zeros(len(triggers), schema.trigger_dtype())
            for i, (kind, value, ref) in enumerate(triggers):
                rows[i] = (step, kind.encode(), value, ref, 1 if kept else 0)
            batch.triggers = rows
            if kept:
                keep = True
                first = step - self.window
                batch.promote = [(st, *got) for st, got in (
                    (st, held_ranges(cmin, cmax)) for st, cmin, cmax in self._memory
                    if st >= first) if got is not None]
                self._memory = collections.deque(
                    (m for m in self._memory if m[0] < first), maxlen=self.slots)
        if keep or not len(batch.chan_min):
            materialize(batch)  # kept for good: copied out of the op's ring now
            return
        batch.ring = True
        held = rec["chan_offset"] >= 0
        rec["flags"] = np.where(held, rec["flags"] | schema.FLAG_RING, rec["flags"])
        self._memory.append((step, batch.chan_min, batch.chan_max))
        self.lazy.note_ring(step, batch.chan_min)

    def _refeeds(self, ids: np.ndarray) -> bool:
        """This step's input ids are the previous step's with one more token (appended, or
        written into one position of a fixed-width buffer): a decode step of a loop that
        re-feeds its whole sequence, not a new prompt."""
        prev = self._prev_ids
        if prev is None or len(ids) < 2:
            return False
        if len(ids) == len(prev) + 1:
            return bool(np.array_equal(ids[:-1], prev))
        return len(ids) == len(prev) and int(np.count_nonzero(ids != prev)) == 1

    def _triggers(self, s: np.void, rec: np.ndarray, growth: bool = True
                  ) -> list[tuple[str, float, float]]:
        out: list[tuple[str, float, float]] = []
        if step_is_bad(np.array([s], s.dtype)):
            bad = int(s["n_nonfinite_records"]) + int(s["logits_nan"]) + int(s["logits_inf"])
            out.append(("nonfinite", float(max(bad, 1)), math.nan))
        if not growth:
            return out
        mids = rec["module_id"]
        gemm_in = ((rec["io"] == schema.IO_INPUT) & (mids >= 0)
                   & self._is_gemm.take(mids, mode="clip"))
        vals = rec["absmax"][gemm_in]
        vals = vals[np.isfinite(vals)]
        if len(vals):
            out += self._grew("outlier_growth", float(vals.max()), self._outliers)
        if int(s["has_logits"]):
            lg = max(abs(float(s["logits_min"])), abs(float(s["logits_max"])))
            if math.isfinite(lg):
                out += self._grew("logits", lg, self._logits)
        return out

    def _grew(self, kind: str, value: float, history: collections.deque
              ) -> list[tuple[str, float, float]]:
        ref = float(max(history)) if len(history) >= _MIN_HISTORY else math.nan
        history.append(value)
        if math.isfinite(ref) and ref > 0 and value > self.growth * ref:
            return [(kind, value, ref)]
        return []
