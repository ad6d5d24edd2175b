"""The stats op's eager calls on the CPU without torch's dispatcher: hooks/opcall.c, a small
CPython extension built and cached like fused_reduce.c (hooks/extension.py, the system C
compiler, Python's headers; off the hook's thread; hooks/prebuild.py builds it at install).

Why: on the op path (`capture(..., compiled=True)` on an eager model, a compiled model's graph
breaks) every eager hook calls the stats op once. Measured with
`python bench/capture_overhead.py --no-nnsight --tokens 32 --rounds 3` on a 2-core Zen 3: the
op path cost 1.286 x plain against 1.126 for a bare hook, and 1.084 with the op call made a
no-op: the whole difference is the call, ~25-30 us each between the real model's GEMMs for ~2
us of reduction (7 us on warm caches in a loop), the dispatcher's parsing and boxing of its 11
arguments on cold caches. An `OpCall` per call site (`lanes`) hands the call's tensors to the
same C function the op's C++ kernel calls first (fused_reduce.c `qf_group`), into the same ring
row; it gives the call back to the op (False) whenever the op has more to do than that: a
non-finite value (exact pass, first-failure word, snapshot), another dtype or device, a strided
tensor, a tensor given twice. So the ring holds the op's figures either way, and the op stays
the one definition of a call.

Used only where the op's CPU kernel is the C++ one (hooks/statsnative.py): with the Python
kernel (`QFORENSICS_STATS_KERNEL=python`) every call goes to the op. `QFORENSICS_OP_LANE=off`
turns the lane off; the trace's status counts the calls each way (`graph_eager_calls`).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import torch

from qforensics.hooks import fused, statscpu, statsnative, statsop
from qforensics.hooks.extension import Extension

SOURCE = Path(__file__).with_name("opcall.c")
MODULE = "qf_op_call"
# the dtypes in the order of qf_group's codes (0, 1, ...): OpCall finds a tensor's code there
DTYPES = tuple(sorted(statscpu.GROUP_DTYPE, key=statscpu.GROUP_DTYPE.__getitem__))


class Lane(Extension):
    """opcall.c: its OpCall type once built; None until then (and for good when off)."""

    def __init__(self, off: str | None = None) -> None:
        super().__init__(SOURCE, MODULE, off, "qforensics-build-opcall")

    def op_call_type(self) -> type | None:
        mod = self.module()
        return mod.OpCall if mod is not None else None


def _off() -> str | None:
    if os.environ.get("QFORENSICS_REDUCE", "auto").lower() == "eager":
        return "QFORENSICS_REDUCE=eager"
    if os.environ.get("QFORENSICS_OP_LANE", "auto").lower() == "off":
        return "QFORENSICS_OP_LANE=off"
    return None


LANE = Lane(_off())


def lanes(gs: Any, calls: tuple[tuple[Any, ...], ...]) -> tuple[Any, ...] | None:
    """One OpCall per op call of an eager plan (graphhooks `_call_plan`); () when the op is to
    run every call (a ring on a GPU, the Python kernel, the lane off or not buildable); None
    while the extension is still being built (asked again at the next call)."""
    if (gs.device.type != "cpu" or statsnative.KERNEL.get("kernel") != "c++"
            or LANE.off is not None):
        return ()
    op_call = LANE.op_call_type()
    group = fused.REDUCER.group()
    if op_call is None or group is None:  # building; never, where either one is off
        return () if LANE.off is not None or fused.REDUCER.off is not None else None
    toks = gs.toks
    if toks.dtype != torch.float32 or toks.dim() != 3 or not toks.is_contiguous():
        return ()
    fn = int(ctypes.cast(group, ctypes.c_void_p).value or 0)
    snap = gs.snap.buf  # the first outlier's region: an input at its threshold goes to the op
    b0, _ = statsop.snap_region(snap.numel(), 1)
    otaken = snap.data_ptr() + 4 * (b0 + statsop.SNAP["taken"])
    othr = float(snap[statsop.SNAP["thr"]])
    out = []
    for ring, _i, _j, offs, caps, tks, ents, pairs in calls:
        if ring.dtype != torch.float32 or ring.dim() != 2 or ring.stride(1) != 1:
            return ()
        out.append(op_call(fn, ring.data_ptr(), ring.shape[0], ring.stride(0), toks.data_ptr(),
                           toks.shape[0], toks.shape[1], toks.shape[2], toks.stride(0),
                           gs.step_t.data_ptr(), statsop.STAMP_MOD, tuple(ents), tuple(offs),
                           tuple(caps), tuple(tks), DTYPES, (ring, toks, gs.step_t, snap),
                           otaken, othr, tuple(k for k, p in enumerate(pairs) if p <= -2),
                           statsop.COL["min"], statsop.COL["max"]))
    return tuple(out)
