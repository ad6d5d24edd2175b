"""Snapshots: full tensors of the calls that matter (the first non-finite output, the first GEMM
input past the outlier threshold), with a tile of the layer's weights around the first bad output
column, under a byte budget. What replay and what-if start from."""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np
import torch
from torch import nn

from qforensics.trace import schema

log = logging.getLogger("qforensics.hooks.capture")

_MAX_NONFINITE_POSITIONS = 256


class Snapshots:
    """The snapshot rows and bytes kept so far in a run, handed to the writer step by step."""

    def __init__(self, *, budget: int, tile_rows: int, outlier_threshold: float,
                 modules: list[nn.Module], kinds: list[str], gemm_ids: np.ndarray) -> None:
        self.budget = budget
        self.tile_rows = tile_rows
        self.outlier_threshold = outlier_threshold
        self._modules = modules
        self._kinds = kinds
        self._gemm_ids = gemm_ids
        self.bytes_kept = 0
        self.snapped: set[str] = set()  # reasons already snapshotted
        self.rows: list[np.ndarray] = []
        self.data: list[np.ndarray] = []
        self._step = -1

    @property
    def done(self) -> bool:
        """Every snapshot reason has been used: nothing more to keep in this run."""
        return len(self.snapped) == len(schema.SNAPSHOT_REASONS)

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        """The rows and bytes kept since the last call (offsets relative to those bytes)."""
        snaps = (np.concatenate(self.rows) if self.rows
                 else np.zeros(0, schema.snapshot_dtype()))
        data = np.concatenate(self.data) if self.data else np.zeros(0, np.uint8)
        self.rows, self.data = [], []
        return snaps, data

    def maybe_snapshot(self, part: dict[str, Any], meta: list, tensors: list, step: int) -> None:
        """Keep the first non-finite output's call and the first outlier GEMM input's call."""
        self._step = step
        rec = part["records"]
        if len(rec) == 0 or len(self.snapped) == len(schema.SNAPSHOT_REASONS):
            return
        if "first_nonfinite_output" not in self.snapped:
            bad = (rec["io"] == schema.IO_OUTPUT) & ((rec["nan_count"] + rec["inf_count"]) > 0)
            if bad.any():
                i = int(np.argmax(bad))
                self.snapped.add("first_nonfinite_output")
                self._snapshot_call("first_nonfinite_output", int(rec["call_index"][i]),
                                    int(rec["module_id"][i]), meta, tensors)
        if "first_outlier" not in self.snapped:
            gemm = np.isin(rec["module_id"], self._gemm_ids)
            hot = gemm & (rec["io"] == schema.IO_INPUT) & (
                rec["absmax"] >= self.outlier_threshold) & (
                (rec["flags"] & schema.FLAG_NONFLOAT) == 0)
            if hot.any():
                i = int(np.argmax(hot))
                self.snapped.add("first_outlier")
                ci = int(rec["call_index"][i])
                same = [r for r in self.rows if int(r["call_index"][0]) == ci]
                if same:  # the same call was just kept for its NaN: point at those bytes
                    for r in same:
                        dup = r.copy()
                        dup["reason"] = b"first_outlier"
                        self.rows.append(dup)
                else:
                    self._snapshot_call("first_outlier", ci, int(rec["module_id"][i]), meta,
                                        tensors)

    def _snapshot_call(self, reason: str, ci: int, mid: int, meta: list, tensors: list) -> None:
        try:
            items: list[tuple[str, torch.Tensor]] = []
            out = None
            for (c, m, io, slot), t in zip(meta, tensors):
                if c == ci:
                    items.append((f"{'input' if io == 0 else 'output'}.{slot}", t))
                    if io == 1 and slot == 0:
                        out = t
            module = self._modules[mid] if 0 <= mid < len(self._modules) else None
            r0 = 0
            if out is not None and out.is_floating_point() and not out.is_meta:
                pos = torch.nonzero(~torch.isfinite(out))[:_MAX_NONFINITE_POSITIONS]
                if len(pos):
                    items.append(("nonfinite_positions", pos))
                    r0 = int(pos[0, -1])
            if module is not None and self._kinds[mid] in ("linear", "quantized_linear"):
                items += self._weight_tile(module, r0)
            for name, t in items:
                self._keep(reason, ci, mid, name, t)
        except Exception as exc:
            log.warning("qforensics: snapshot of call %d failed (%s); continuing", ci, exc)

    def _weight_tile(self, module: nn.Module, col: int) -> list[tuple[str, torch.Tensor]]:
        """Weights covering a tile of output columns around `col` (dense or AWQ/GPTQ packed)."""
        tile = max(8, self.tile_rows)
        out: list[tuple[str, torch.Tensor]] = []
        w = getattr(module, "weight", None)
        qw = getattr(module, "qweight", None)
        if isinstance(qw, torch.Tensor):
            n_out = qw.shape[1] * 8
            c0 = (col // tile) * tile
            c1 = min(n_out, c0 + tile)
            out.append(("qweight", qw[:, c0 // 8:(c1 + 7) // 8]))
            for name in ("qzeros",):
                t = getattr(module, name, None)
                if isinstance(t, torch.Tensor):
                    out.append((name, t[:, c0 // 8:(c1 + 7) // 8]))
            sc = getattr(module, "scales", None)
            if isinstance(sc, torch.Tensor):
                out.append(("scales", sc[:, c0:c1]))
            g = getattr(module, "g_idx", None)
            if isinstance(g, torch.Tensor):
                out.append(("g_idx", g))
            out.append(("weight_cols", torch.tensor([c0, c1, n_out])))
        elif isinstance(w, torch.Tensor) and w.dim() == 2 and not w.is_meta:
            n_out = w.shape[0]
            r0 = (col // tile) * tile if col < n_out else 0
            r1 = min(n_out, r0 + tile)
            out.append(("weight", w[r0:r1]))
            out.append(("weight_rows", torch.tensor([r0, r1, n_out])))
        b = getattr(module, "bias", None)
        if isinstance(b, torch.Tensor):
            out.append(("bias", b))
        return out

    def _keep(self, reason: str, ci: int, mid: int, name: str, t: torch.Tensor) -> None:
        t = t.detach()
        if t.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
            t = t.to(torch.float32)
        arr = t.cpu().contiguous().numpy()
        arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
        budget = self.budget - self.bytes_kept
        truncated = 0
        if arr.nbytes > budget:
            if arr.ndim == 0 or budget <= 0:
                return
            per_row = max(1, arr.nbytes // max(arr.shape[0], 1))
            keep = budget // per_row
            if keep <= 0:
                return
            arr = arr[:keep]
            truncated = 1
        row = np.zeros(1, schema.snapshot_dtype())
        row["call_index"], row["step"], row["module_id"] = ci, self._step, mid
        row["reason"], row["name"] = reason.encode(), name.encode()
        row["dtype"] = arr.dtype.name.encode()
        row["shape"] = json.dumps(list(arr.shape)).encode()
        row["offset"] = sum(len(d) for d in self.data)
        row["nbytes"] = arr.nbytes
        row["truncated"] = truncated
        self.rows.append(row)
        self.data.append(np.frombuffer(np.ascontiguousarray(arr).tobytes(), np.uint8))
        self.bytes_kept += arr.nbytes
