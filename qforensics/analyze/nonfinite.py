"""The first non-finite value in call order, who produced it, and how far it spread.

Producer: the first call whose inputs are all finite and whose output is not. When the first
non-finite value is already in a call's input, an unhooked op between the last finite hooked
output and that input produced it (a `Gap`); the module that received it only propagated it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from qforensics.analyze.findings import FirstNonfinite, Gap, Spread
from qforensics.trace import schema
from qforensics.trace.badstep import bad_steps, first_bad_row
from qforensics.trace.reader import Trace
from qforensics.trace.table import Table

__all__ = ["find_first_bad_step", "find_first_nonfinite", "kind_word"]


def kind_word(kind: str) -> str:
    return {"nan": "NaN", "inf": "Inf", "nan+inf": "NaN and Inf"}.get(kind, kind)


def _kind(nan: int, inf: int) -> str:
    if nan and inf:
        return "nan+inf"
    return "nan" if nan else "inf"


def find_first_bad_step(steps: Table, *, warmup: Any = None,
                        count_warmup: bool = False) -> int | None:
    """Row (position in /steps) of the first bad step (NaN/Inf in a record or in its logits,
    `trace.badstep`), from the per-step summaries alone; warm-up forwards (`warmup`: their step
    numbers) are left out unless `count_warmup`."""
    return first_bad_row(steps, warmup=warmup, count_warmup=count_warmup)


def _f(x: object) -> float | None:
    try:
        v = float(x)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def find_first_nonfinite(trace: Trace, steps: Table, step_row: int,
                         recs: Table) -> FirstNonfinite | None:
    """Locate the first non-finite record of the step at `step_row` (its records are `recs`);
    None when none of them holds NaN/Inf (the step went bad in its logits alone)."""
    srow = steps.row(step_row)
    step = int(srow["step"])
    bad = (recs["nan_count"] + recs["inf_count"]) > 0
    if not len(recs) or not bad.any():
        return None
    hint = int(srow["first_nonfinite_record"])
    pos = None
    if hint >= 0:
        hit = np.nonzero(recs["row"] == hint)[0]
        if len(hit) and bad[hit[0]]:
            pos = int(hit[0])
            # the hint must be the first bad one in call order; trust the data if it is not
            earlier = np.nonzero(bad[:pos])[0]
            if len(earlier):
                pos = int(earlier[0])
    if pos is None:
        pos = int(np.argmax(bad))
    rec = recs.row(pos)
    call = int(rec["call_index"])
    mid = int(rec["module_id"])
    module = str(rec["module"]) or "(model output)"
    kinds = trace.module_kinds
    io = int(rec["io"])
    nan, inf = int(rec["nan_count"]), int(rec["inf_count"])
    mutated = bool(int(rec["flags"]) & schema.FLAG_MUTATED)
    if io == schema.IO_OUTPUT:
        producer: str | Gap = module
        ins = np.nonzero((recs["call_index"] == call) & (recs["io"] == schema.IO_INPUT))[0]
        if len(ins):
            i0 = int(ins[0])
            in_min, in_max, in_abs = (_f(recs[k][i0]) for k in ("min", "max", "absmax"))
        else:
            in_min = in_max = in_abs = None
    else:
        before = np.nonzero((recs["call_index"] < call) & (recs["io"] == schema.IO_OUTPUT))[0]
        if len(before):
            lr = int(before[-1])
            last_call = int(recs["call_index"][lr])
            last_mod = str(recs["module"][lr]) or "(model output)"
            where = f"after call {last_call} ({last_mod}), whose output is finite"
        else:
            last_call, last_mod = None, None
            where = "before it; no hooked call of this step had an output before it"
        word = kind_word(_kind(nan, inf))
        desc = (f"{word} is already in the input of {module} (call {call}): an unhooked op "
                f"{where}, produced it; {module} only propagated it")
        if mutated:
            desc += (" (note: this input was modified in place after the call, so its recorded "
                     "stats may show a later value)")
        producer = Gap(last_call, last_mod, call, module, desc)
        in_min = in_max = in_abs = None
    spread = _spread(trace, steps, step_row, recs)
    return FirstNonfinite(
        step=step, call_index=call, module=module, module_kind=str(kinds[mid]) if 0 <= mid < len(
            kinds) else "?", io=io, tensor="output" if io == schema.IO_OUTPUT else "input",
        slot=int(rec["slot"]), kind=_kind(nan, inf), nan_count=nan, inf_count=inf,
        numel=int(rec["numel"]), producer=producer, input_min=in_min, input_max=in_max,
        input_absmax=in_abs, spread=spread, record_row=int(rec["row"]),
        t_start=float(srow["t_start"]), mutated=mutated,
    )


def _spread(trace: Trace, steps: Table, step_row: int, recs: Table) -> Spread:
    """Modules and steps non-finite from the first bad step on. Reads three narrow record
    columns of the steps after the failing one (not their channel data)."""
    n_after = len(steps) - step_row
    n_bad = int(bad_steps(steps)[step_row:].sum())
    logits_bad = int(((steps["logits_nan"] > 0) | (steps["logits_inf"] > 0)).sum())
    bad_now = (recs["nan_count"] + recs["inf_count"]) > 0
    mods = set(recs["module_id"][bad_now].tolist())
    start = int(steps["record_offset"][step_row]) + int(steps["record_count"][step_row])
    end = trace.records_end
    if end > start:
        cols = trace.record_columns(["module_id", "nan_count", "inf_count"])
        sl = slice(start, end)
        b = (cols["nan_count"][sl] + cols["inf_count"][sl]) > 0
        mods.update(np.unique(cols["module_id"][sl][b]).tolist())
    return Spread(n_modules=len(mods), n_modules_total=trace.n_modules, n_steps=n_bad,
                  n_steps_after=n_after, n_records=int(bad_now.sum()),
                  logits_nonfinite_steps=logits_bad)
