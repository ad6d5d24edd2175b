"""A run against a reference trace of the same prompt (`analyze --reference`, `report
--reference`): the first module whose output error reaches the diff's jump threshold, the error
level of each decoder layer and its growth, and whether the error starts at a quantized layer or
after the quantized layers. No torch import.

A module counts as quantized when its info records a quantization, or when its parameter
health differs from the reference's (the weights were changed in place: exact-zero count or
levels per group differ), so in-place fake-quantized weights count too.
"""

from __future__ import annotations

import math
import os

from qforensics.analyze.diff import diff_traces
from qforensics.analyze.findings import DiffFindings, Divergence, ReferenceComparison
from qforensics.trace.moduleinfo import ModuleInfos, read_module_infos
from qforensics.trace.reader import Trace, open_trace

__all__ = ["compare_to_reference", "quantized_modules"]


def quantized_modules(infos: ModuleInfos, ref: ModuleInfos | None) -> set[str]:
    out = {name for name, q in infos.quant.items() if q.get("format")}
    if ref is not None:
        theirs = {(h.module, h.param): (h.zero, h.levels.levels_median if h.levels else None)
                  for h in ref.health}
        for h in infos.health:
            key = (h.module, h.param)
            mine = (h.zero, h.levels.levels_median if h.levels else None)
            if key in theirs and theirs[key] != mine:
                out.add(h.module)
    return out


def _block_of(module: str, blocks: list[str]) -> str | None:
    inside = [b for b in blocks if module == b or module.startswith(b + ".")]
    return max(inside, key=len) if inside else None


def compare_to_reference(reference: str | os.PathLike[str], trace: Trace,
                         infos: ModuleInfos, *, diff: DiffFindings | None = None
                         ) -> ReferenceComparison:
    """Compare `trace` with `reference` (both of the same prompt); `diff`: that comparison's
    `diff_traces(reference, trace, top=100000)` when already computed. Raises a
    QForensicsError (TraceFormatError / UsageError) when the reference cannot be read."""
    ref_path = os.fspath(reference)
    with open_trace(ref_path) as ref:
        ref_infos = read_module_infos(ref)
    if diff is None:
        diff = diff_traces(ref_path, trace.path, top=100_000)
    kinds = dict(zip(trace.module_names, trace.module_kinds))
    blocks = [n for n, k in kinds.items() if k == "block"]
    quant = quantized_modules(infos, ref_infos)
    # every non-block output, in reference call order
    outs = sorted(diff.ranked, key=lambda d: (d.step, d.call_index, d.slot))
    per: dict[str, float] = {}
    for d in outs:
        b = _block_of(d.module, blocks)
        if b is not None and not math.isnan(d.score):
            per[b] = max(per.get(b, 0.0), d.score)
    order = [b for b in blocks if b in per]
    rows = []
    prev = None
    for b in order:
        s = per[b]
        growth = (s / prev) if prev and math.isfinite(s) and prev > 0 else None
        rows.append({"layer": b, "score": s, "growth": growth,
                     "quantized_modules": sum(1 for q in quant if _block_of(q, blocks) == b)})
        prev = s
    # the first module (call order) whose output error reaches the jump threshold: where the
    # error is first large, even when it builds up over several modules
    th = float(diff.thresholds.get("jump", 0.3))
    first: Divergence | None = next((d for d in outs if d.score >= th), None)
    notes = list(diff.notes)
    if first is None:
        starts, where = "none", f"no module's output error reaches {th:g}"
    else:
        before = [d.module for d in outs if (d.step, d.call_index) <= (first.step,
                                                                       first.call_index)]
        if first.module in quant:
            starts, where = "quantized", f"the error starts at a quantized layer, {first.module}"
        elif any(m in quant for m in before):
            starts = "after_quantized"
            where = (f"the error starts at {first.module}, after the quantized layers before it "
                     "(which add less than the threshold)")
        else:
            starts = "unquantized"
            where = f"the error starts at {first.module}, before any quantized layer"
    grow = [r for r in rows if r["growth"] is not None]
    tail = ""
    if rows:
        tail = (f"; error from {rows[0]['score']:.3g} ({rows[0]['layer']}) to "
                f"{rows[-1]['score']:.3g} ({rows[-1]['layer']})")
        if grow:
            g = max(grow, key=lambda r: r["growth"])
            tail += f", fastest growth x{g['growth']:.3g} at {g['layer']}"
    line = f"against {ref_path}: {where}{tail}"
    if not quant:
        notes.append("no module is known to be quantized (no quantization recorded and the "
                     "parameters match the reference)")
    return ReferenceComparison(ref_path, diff.verdict.status, line, first, rows, starts, notes)
