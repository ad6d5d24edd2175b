"""Helpers for the replay tests (a uniquely named module, not conftest, so it cannot clash): synthetic AWQ snapshots and a fake trace object."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pandas as pd

from qforensics.layouts.bits import pack_awq


def make_awq(m: int, n: int, k: int, group_size: int, *, groups: int | None = None, seed: int = 0,
             lead: tuple[int, ...] = ()) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    groups = groups if groups is not None else k // group_size
    return {
        "input.0": rng.standard_normal((*lead, m, k) if lead else (m, k)).astype(np.float16),
        "qweight": pack_awq(rng.integers(0, 16, (k, n))),
        "qzeros": pack_awq(rng.integers(0, 16, (groups, n))),
        "scales": (rng.random((groups, n)) * 0.01 + 0.001).astype(np.float16),
    }


class FakeTrace:
    """Exposes exactly the trace reader API replay codes against (snapshots, modules, snapshot_tensors)."""

    def __init__(self, calls: dict[int, tuple[str, dict[str, np.ndarray]]], module_info: dict | None = None,
                 truncated: bool = False) -> None:
        rows = []
        for call, (reason, tensors) in calls.items():
            for name, arr in tensors.items():
                rows.append({"call_index": call, "step": 0, "module_id": 3, "module": "model.layers.0.mlp.down_proj",
                             "reason": reason, "name": name, "dtype": str(arr.dtype), "shape": list(arr.shape),
                             "truncated": truncated})
        self.snapshots = pd.DataFrame(rows)
        self.modules = pd.DataFrame([{"name": "model.layers.0.mlp.down_proj", "type": "WQLinear_GEMM",
                                      "info": json.dumps(module_info or {})}])
        self._calls = calls
        self.opened = []

    def snapshot_tensors(self, call_index: int) -> dict[str, np.ndarray]:
        return dict(self._calls[call_index][1])


def fake_opener(trace: FakeTrace):
    @contextlib.contextmanager
    def open_trace(path):
        trace.opened.append(str(path))
        yield trace

    return open_trace
