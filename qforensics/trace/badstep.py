"""What "this step went bad" means, decided once for the writer and every reader. No h5py.

A step is bad when any of its records, or its logits, held a NaN or an Inf: its summary row
(a /steps row, a batch's step rows, or a DataFrame of them) counts non-finite records, names a
first non-finite record or call, or counts NaN/Inf in the logits. A step whose only
non-finite values are in the logits is bad (the logits may come from an op no hook sees).

Warm-up / profile forwards (a serving engine's dummy batches, flagged in /engine/steps) are
recorded and counted where a count of them matters, but by default they are never bad here:
nothing a warm-up did may be "the first failure". `count_warmup=True` judges them like any
other step (to report what the warm-ups did).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["bad_steps", "first_bad_row", "first_bad_step", "step_is_bad"]

# the /steps columns the rule reads: counts (bad when > 0) and first positions (bad when >= 0)
_COUNTS = ("n_nonfinite_records", "logits_nan", "logits_inf")
_FIRSTS = ("first_nonfinite_record", "first_nonfinite_call")


def _col(steps: Any, name: str) -> np.ndarray:
    return np.asarray(steps[name])


def _has(steps: Any, name: str) -> bool:
    names = getattr(getattr(steps, "dtype", None), "names", None)  # a structured array
    return name in names if names is not None else name in steps


def _warm_mask(steps: Any, n: int, warmup: Any) -> np.ndarray:
    """Rows of `steps` that are warm-up forwards: `warmup` is a bool flag per row, or the
    warm-up step numbers."""
    if warmup is None:
        return np.zeros(n, bool)
    w = np.asarray(list(warmup) if not isinstance(warmup, np.ndarray) and isinstance(
        warmup, Iterable) else warmup)
    if w.dtype == bool:
        if w.shape != (n,):
            raise ValueError(f"warm-up flags for {w.shape} rows, the steps have {n}")
        return w
    if not w.size:
        return np.zeros(n, bool)
    return np.isin(_col(steps, "step").astype(np.int64), w.astype(np.int64))


def bad_steps(steps: Any, *, warmup: Any = None, count_warmup: bool = False) -> np.ndarray:
    """Per row of `steps`: whether that step went bad (NaN/Inf in any record or in its
    logits). `warmup`: which rows are warm-up forwards (a bool per row, or their step numbers;
    None: none are); unless `count_warmup`, a warm-up row is never bad."""
    n = len(steps)
    bad = np.zeros(n, bool)
    for name in _COUNTS + _FIRSTS:
        if _has(steps, name):  # a column a table lacks says nothing
            col = _col(steps, name)
            bad |= (col > 0) if name in _COUNTS else (col >= 0)
    if not count_warmup:
        bad &= ~_warm_mask(steps, n, warmup)
    return bad


def step_is_bad(steps: Any, *, warmup: Any = None, count_warmup: bool = False) -> bool:
    """A one-row step table (one captured step, one batch) went bad."""
    return bool(len(steps) == 1
                and bad_steps(steps, warmup=warmup, count_warmup=count_warmup)[0])


def first_bad_row(steps: Any, *, warmup: Any = None, count_warmup: bool = False) -> int | None:
    """Position in `steps` of the first bad step (rows in step order), None when none is."""
    if not len(steps):
        return None
    bad = bad_steps(steps, warmup=warmup, count_warmup=count_warmup)
    return int(np.argmax(bad)) if bad.any() else None


def first_bad_step(steps: Any, *, warmup: Any = None, count_warmup: bool = False
                   ) -> int | None:
    """The step number of the first bad step, None when none is."""
    row = first_bad_row(steps, warmup=warmup, count_warmup=count_warmup)
    return None if row is None else int(_col(steps, "step")[row])
