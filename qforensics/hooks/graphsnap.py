"""Compiled mode's snapshot: the first failing output's call, kept inside the graph.

The stats op (hooks/statsop.py, `snap` and `pair`) copies that call's input rows and its output
into one static float32 buffer on the device, once a run, from inside the graph (a CUDA graph
replays it: no sync, no allocation). Here the host's side: at the first collected step whose
records hold a non-finite output, the header is read (on a GPU one blocking read: the failure
path, once a run), the input and output rebuilt as [rows, channels] in their own dtypes, and
handed to the session's Snapshots like eager mode's, so the snapshot rows, the weight tile and
call.json come out the same and `qforensics replay` starts from them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from qforensics.hooks import statsop
from qforensics.hooks.statsop import SNAP, SNAP_HEADER, STAMP_MOD
from qforensics.trace import schema

MAX_BYTES = 16 << 20  # a region's floats at most (input and output together)
# the recorded dtype back (exact: the values came from it); an integer one as int64
_DTYPES = {code: getattr(torch, name) for name, code in schema.DTYPE_CODES.items()
           if name.startswith(("float", "bfloat")) or name == "bool"}
_DTYPES[schema.DTYPE_CODES["int"]] = torch.int64


REASONS = ("first_nonfinite_output", "first_outlier")  # the buffer's regions, in order


class CompiledSnap:
    """The device buffer (`buf`, marked static: statsop.new_snap's two regions) and what
    became of each region's call (`states`)."""

    def __init__(self, device: torch.device, budget: int,
                 threshold: float = float("inf")) -> None:
        self.capacity = max(0, min(int(budget), MAX_BYTES) // 4)  # floats a region
        self.buf = statsop.new_snap(device, self.capacity, threshold)
        torch._dynamo.mark_static_address(self.buf)
        # read once each; nothing to read without a budget (or, the second, a threshold)
        self.read_done = [self.capacity == 0,
                          self.capacity == 0 or not float(threshold) < float("inf")]
        self.states: list[dict[str, Any]] = [
            {"taken": False, "why": "no snapshot budget"} if self.capacity == 0 else
            {"taken": False, "why": "no output went non-finite"},
            {"taken": False, "why": "no snapshot budget" if self.capacity == 0 else
             "no outlier threshold" if self.read_done[1] else "no input reached the threshold"}]

    @property
    def done(self) -> bool:
        return all(self.read_done)

    def read(self, rec: np.ndarray, step: int, entries: list[Any], which: int = 0
             ) -> tuple[int, int, list, list, set[str]] | None:
        """At the first step whose records (`rec`) hold region `which`'s call (0: a non-finite
        output; 1: a GEMM input at the outlier threshold): the kept call as (call index,
        module, meta, tensors, names truncated) for Snapshots, or None (why in `states`).
        Once a run each."""
        self.read_done[which] = True
        a0, _ = statsop.snap_region(self.buf.numel(), which)
        st = self.states[which]
        h = self.buf[a0:a0 + SNAP_HEADER].cpu().numpy().astype(np.int64)
        if h[SNAP["taken"]] == 0:
            st["why"] = f"the {REASONS[which]} call was not kept on the device"
            return None
        e_out, e_in = int(h[SNAP["out_entry"]]), int(h[SNAP["in_entry"]])
        if int(h[SNAP["step"]]) != step % STAMP_MOD or not 0 <= e_out < len(entries):
            st["why"] = f"kept at another step ({int(h[SNAP['step']])})"
            return None
        out = entries[e_out]
        hit = np.nonzero((rec["module_id"] == out.mid) & (rec["io"] == out.io)
                         & (rec["slot"] == out.slot))[0]
        if not len(hit):
            st["why"] = "its record is not in the step"
            return None
        # a module run twice in the step: its records in call order, one per entry, placed in
        # the same order (graphstats.place)
        ci = int(rec["call_index"][hit[min(out.nth, len(hit) - 1)]])
        k_in, k_out = int(h[SNAP["in_kept"]]), int(h[SNAP["out_kept"]])
        body = self.buf[a0 + SNAP_HEADER:a0 + SNAP_HEADER + k_in + k_out].cpu()
        meta, tensors, cut = [], [], set()
        parts = [("output", out, body[k_in:], h[SNAP["out_rows"]], h[SNAP["out_chans"]])]
        if 0 <= e_in < len(entries):
            parts.insert(0, ("input", entries[e_in], body[:k_in], h[SNAP["in_rows"]],
                             h[SNAP["in_chans"]]))
        for kind, ent, flat, rows, chans in parts:
            kept = min(int(rows), flat.numel() // max(int(chans), 1))
            t = flat[:kept * int(chans)].reshape(kept, int(chans))
            tensors.append(t.to(_DTYPES.get(ent.dtype, torch.float32)))
            meta.append((ci, ent.mid, ent.io, ent.slot))
            if kept < rows:
                cut.add(f"{kind}.{ent.slot}")
        self.states[which] = {"taken": True, "step": int(step), "call_index": ci,
                              "module_id": out.mid, "truncated": sorted(cut)}
        return ci, out.mid, meta, tensors, cut
