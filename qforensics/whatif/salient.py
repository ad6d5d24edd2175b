"""Salient input channels from a trace: per-input-channel activation absmax of every Linear.

A trace stores, per call and for steps chosen at capture (``channel_steps``), the per-channel
min and max of each hooked module's input (`Trace.channel_block`, one read per step).
The absmax of channel c is ``max(|min_c|, |max_c|)``, maximised over every step that stored it.
This is exactly what `qforensics.quant.select_salient_channels` ranks, so the what-if can pick
the channels the failing run really saw instead of running a calibration pass.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from qforensics.formats import GEMM_KINDS
from qforensics.trace import schema
from qforensics.trace.reader import Trace, open_trace

__all__ = ["TraceAbsmax", "absmax_from_trace", "outlier_layers"]



@dataclass
class TraceAbsmax:
    """Per-input-channel absmax by module name (float32 numpy [K]), and where it came from."""

    absmax: dict[str, np.ndarray] = field(default_factory=dict)
    steps: list[int] = field(default_factory=list)  # steps that contributed channel ranges
    records: int = 0  # input records read

    def describe(self) -> str:
        if not self.absmax:
            return "the trace stores no per-channel input ranges"
        s = self.steps
        span = f"step {s[0]}" if len(s) == 1 else f"{len(s)} steps ({s[0]}..{s[-1]})"
        return (f"recorded activation ranges of {len(self.absmax)} Linears over {span}, "
                f"{self.records} input records")


def absmax_from_trace(trace: Trace | str | os.PathLike[str],
                      modules: list[str] | None = None) -> TraceAbsmax:
    """Per-input-channel absmax of each Linear's first input, from the trace's channel ranges.

    ``modules`` limits the result to those names. A channel that was NaN in every stored step
    stays NaN (salient selection then treats it as the largest: the one to look at); a NaN in
    some steps is ignored where another step has a value.
    """
    if not isinstance(trace, Trace):
        with open_trace(trace) as t:
            return absmax_from_trace(t, modules)
    kinds = trace.modules["kind"].to_numpy()
    names = trace.modules["name"].to_numpy()
    gemm = {int(i) for i, k in enumerate(kinds) if k in GEMM_KINDS}
    want = set(modules) if modules is not None else None
    out = TraceAbsmax()
    for step in trace.iter_steps():
        df = trace.records(step)
        sel = df[(df["io"] == schema.IO_INPUT) & (df["slot"] == 0) & df["module_id"].isin(gemm)]
        if want is not None:
            sel = sel[sel["module"].isin(want)]
        if sel.empty:
            continue
        block = trace.channel_block(sel, tokens=False)  # one read for the whole step
        if not block.rows:
            continue
        out.steps.append(step)
        for _, rec in sel.iterrows():
            rng = block.channels(int(rec["row"]))
            if rng is None:
                continue
            lo, hi = rng
            a = np.fmax(np.abs(lo), np.abs(hi)).astype(np.float32)
            name = str(names[int(rec["module_id"])])
            prev = out.absmax.get(name)
            if prev is None:
                out.absmax[name] = a
            elif prev.shape == a.shape:
                out.absmax[name] = np.fmax(prev, a)
            out.records += 1
    return out


def outlier_layers(absmax: dict[str, object], layers: int = 3, channels: int = 8
                   ) -> list[dict[str, object]]:
    """The ``layers`` Linears whose largest input channel stands out most from their typical
    one (absmax / median channel absmax, over the finite channels), each with its
    ``channels`` largest channels, largest first: the ones to keep in higher precision.
    ``absmax``: {module: per-input-channel absmax} (numpy or torch, [K])."""
    rows = []
    for name, a in absmax.items():
        v = np.asarray(a, dtype=np.float64).reshape(-1)
        ok = np.isfinite(v)
        if not ok.any():
            continue
        fin = np.where(ok, v, -np.inf)
        med = float(np.median(v[ok]))
        top = float(fin.max())
        ratio = top / med if med > 0 else (0.0 if top == 0 else float(np.finfo(np.float64).max))
        order = np.argsort(-fin, kind="stable")[:channels]
        rows.append({"module": str(name), "absmax": top, "times_median": ratio,
                     "channels": [int(c) for c in order if ok[c]],
                     "nonfinite_channels": int((~ok).sum())})
    rows.sort(key=lambda r: (-r["times_median"], r["module"]))
    return rows[:layers]
