"""What a trace that holds no NaN/Inf did not record: steps without records, and hooked
modules missing from steps recorded in full. A verdict of PASSED says that every hooked
module was seen finite at every step; where the trace cannot show that, the verdict reads
SUSPECT and names what is missing (a compiled capture that recorded nothing must never pass).

Left out: mixture-of-experts modules (an expert the router did not pick at a step is not
called), the root, and forwards that computed no logits (an engine's dummy batch). No torch
import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from qforensics.formats import KIND_ROOT
from qforensics.trace import schema
from qforensics.trace.reader import Trace
from qforensics.trace.table import Table

__all__ = ["Gaps", "find_gaps"]

# experts are called only for the tokens routed to them (HF's `experts.3.w1`, Mixtral's
# `block_sparse_moe.experts.0`)
_CONDITIONAL = re.compile(r"(^|\.)experts\.\d+(\.|$)")


def _names(names: list[str], most: int = 3) -> str:
    more = f" (+{len(names) - most} more)" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def _steps(steps: list[int], most: int = 4) -> str:
    more = f" (+{len(steps) - most} more)" if len(steps) > most else ""
    return ", ".join(str(s) for s in steps[:most]) + more


@dataclass
class Gaps:
    """`empty`: steps recorded in full that hold no record; `never`: hooked modules with no
    record in any of them; `partial`: {module: steps it is missing from}, for modules seen at
    some steps only; `steps`: how many steps were checked; `spilled`: steps whose per-module
    detail compiled mode gave up when its ring overflowed (`complete` 2): no gap, since the
    op's first-failure word covered them, but said (`note`)."""

    steps: int = 0
    modules: int = 0
    empty: list[int] = field(default_factory=list)
    never: list[str] = field(default_factory=list)
    partial: dict[str, list[int]] = field(default_factory=dict)
    spilled: list[int] = field(default_factory=list)

    def note(self) -> str:
        """The spilled steps, in words ('' when none)."""
        if not self.spilled:
            return ""
        return (f"{len(self.spilled)} of {self.steps} steps kept no per-module detail "
                f"(steps {_steps(self.spilled)}: the capture's ring overflowed; the device's "
                "NaN/Inf check covered them)")

    def line(self) -> str:
        """What is missing, in words ('' when nothing is)."""
        if self.steps and len(self.empty) == self.steps:
            return (f"nothing was recorded: none of the {self.modules} hooked modules has a "
                    f"record in any of the {self.steps} steps")
        out = []
        if self.empty:
            out.append(f"{len(self.empty)} of {self.steps} steps hold no record "
                       f"(steps {_steps(self.empty)})")
        if self.never:
            out.append(f"{len(self.never)} of {self.modules} hooked modules have no record "
                       f"at all ({_names(self.never)})")
        if self.partial:
            worst = max(self.partial, key=lambda m: len(self.partial[m]))
            out.append(f"{len(self.partial)} hooked modules are missing from some steps "
                       f"({worst}: steps {_steps(self.partial[worst])})")
        return "; ".join(out)

    def to_dict(self) -> dict:
        return {"steps": self.steps, "modules": self.modules, "empty_steps": self.empty[:100],
                "never_recorded": self.never[:100],
                "missing_from_steps": {k: v[:20] for k, v in list(self.partial.items())[:100]},
                "spilled_steps": self.spilled[:100], "line": self.line(), "note": self.note()}


def find_gaps(trace: Trace, steps: Table) -> Gaps:
    """The gaps over `steps` (the /steps rows recorded in full, warm-ups left out)."""
    names = [str(n) for n in trace.module_names]
    n_mod = len(names)
    if steps.empty or not n_mod:
        return Gaps(0, n_mod)
    wanted = np.asarray(steps["step"], np.int64)
    counts = np.asarray(steps["record_count"], np.int64)
    complete = np.asarray(steps["complete"])
    spilled = complete == schema.STEP_SPILLED
    whole = (complete != schema.STEP_RAISED) & ~spilled
    # a step cut short by the run's stop (SIGTERM mid-forward) may hold nothing: no gap, as
    # long as some whole step recorded something (a trace of empty steps never passes)
    if not (counts[whole] > 0).any():
        whole[:] = True
    g = Gaps(len(wanted), n_mod, empty=[int(s) for s in wanted[(counts == 0) & whole]],
             spilled=[int(s) for s in wanted[spilled]])
    cols = trace.record_columns(["step", "module_id"])
    st = np.asarray(cols["step"], np.int64)
    mid = np.asarray(cols["module_id"], np.int64)
    keep = np.isin(st, wanted) & (mid >= 0) & (mid < n_mod)
    key = np.unique(st[keep] * n_mod + mid[keep])  # one entry per (step, module) seen
    k_step, k_mod = key // n_mod, key % n_mod
    full = wanted[(counts > 0) & whole]  # the whole steps that recorded anything
    # a forward that computed no logits (an engine's dummy batch: its lm_head and logits are
    # not called) is no gap: where the logits were recorded, only their steps are checked
    root = np.nonzero(np.asarray(trace.module_kinds) == KIND_ROOT)[0]
    with_logits = np.unique(k_step[np.isin(k_mod, root)])
    if len(with_logits):
        full = np.intersect1d(full, with_logits)
        sel = np.isin(k_step, full)
        k_step, k_mod = k_step[sel], k_mod[sel]
    seen = np.bincount(k_mod, minlength=n_mod)
    skip = np.zeros(n_mod, bool)
    skip[root] = True
    skip |= np.array([bool(_CONDITIONAL.search(n)) for n in names])
    g.never = [names[m] for m in np.nonzero((seen == 0) & ~skip)[0]] if len(full) else []
    for m in np.nonzero((seen > 0) & (seen < len(full)) & ~skip)[0]:
        missing = np.setdiff1d(full, k_step[k_mod == m])
        g.partial[names[m]] = [int(s) for s in missing]
    return g
