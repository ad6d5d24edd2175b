"""Quantization layouts of Hugging Face checkpoints and their structural checks.

The layout comes from `quantization_config` in config.json (or AutoGPTQ's quantize_config.json /
AutoAWQ's quant_config.json) and, failing that, from tensor names and shapes. Packed 4-bit
layouts (see shared/reference/awq-layout.md), with pack factor pf = 32 / bits and group size G:

    AWQ (GEMM):  qweight int32 [K, N/pf]   qzeros int32 [K/G, N/pf]   scales [K/G, N]
    GPTQ:        qweight int32 [K/pf, N]   qzeros int32 [K/G, N/pf]   scales [K/G, N]
                 g_idx int32 [K], each in [0, K/G)
    FP8:         weight F8 [N, K] with weight_scale (per-tensor, [N] / [N, 1] per-channel, or
                 [ceil(N/bn), ceil(K/bk)] for weight_block_size [bn, bk])

Only header facts (dtype, shape) are used, except for g_idx and qzeros, which are small and read
whole. Value checks of scale tensors live in `values`; this module only says which names are
scales.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Iterable

import numpy as np

from qforensics.errors import ScanError
from qforensics.layouts import gptq
from qforensics.layouts.bits import unpack_bits
from qforensics.layouts.detect import packed_method
from qforensics.scan.findings import CHECKS, Finding, Skipped
from qforensics.scan.safetensors_file import SafetensorsFile, TensorEntry

__all__ = [
    "QuantConfig",
    "Located",
    "SCALE_SUFFIXES",
    "is_scale_tensor",
    "load_quant_config",
    "check_layout",
]

# Tensor-name suffixes (after the last ".") that hold dequantization scales.
SCALE_SUFFIXES = frozenset({
    "scales", "weight_scale", "weight_scale_inv", "weight_scale_2", "input_scale",
    "output_scale", "k_scale", "v_scale", "q_scale", "weight_global_scale",
    "input_global_scale",
})

_SCALE_DTYPES = {"F16", "BF16", "F32"}
_PACKED_DTYPES = {"I32", "U32"}
_GIDX_DTYPES = {"I32", "I64", "I16", "U32"}


def is_scale_tensor(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in SCALE_SUFFIXES


@dataclass(frozen=True)
class QuantConfig:
    """The parts of a quantization config the structural checks use."""

    method: str | None = None  # "awq", "gptq", "fp8", "compressed-tensors", ...
    bits: int | None = None
    group_size: int | None = None  # -1: one group over all of K
    sym: bool | None = None
    checkpoint_format: str | None = None  # GPTQ: "gptq" (v1), "gptq_v2", "marlin"
    version: str | None = None  # AWQ: "gemm", "gemv", ...
    weight_block_size: tuple[int, int] | None = None
    source: str | None = None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _quant_config_from(d: dict[str, Any], source: str, default_method: str | None) -> QuantConfig:
    method = d.get("quant_method", default_method)
    method = str(method).lower() if method is not None else None
    block = d.get("weight_block_size")
    wbs = None
    if isinstance(block, list) and len(block) == 2 and all(_int(b) for b in block):
        wbs = (int(block[0]), int(block[1]))
    sym = d.get("sym")
    if sym is None and "zero_point" in d:
        sym = not bool(d["zero_point"])
    version = d.get("version")
    fmt = d.get("checkpoint_format")
    return QuantConfig(
        method=method,
        bits=_int(d.get("bits", d.get("w_bit"))),
        group_size=_int(d.get("group_size", d.get("q_group_size"))),
        sym=bool(sym) if sym is not None else None,
        checkpoint_format=str(fmt).lower() if fmt is not None else None,
        version=str(version).lower() if version is not None else None,
        weight_block_size=wbs,
        source=source,
    )


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ScanError(f"{path}: cannot read the model config as JSON ({exc}); fix or remove "
                        f"the file") from exc


def load_quant_config(folder: Path) -> QuantConfig | None:
    """The quantization config of the checkpoint in `folder`, or None for an unquantized one."""
    cfg = folder / "config.json"
    if cfg.is_file():
        data = _read_json(cfg)
        qc = data.get("quantization_config") if isinstance(data, dict) else None
        if isinstance(qc, dict):
            return _quant_config_from(qc, cfg.name, None)
    for name, method in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
        p = folder / name
        if p.is_file():
            data = _read_json(p)
            if isinstance(data, dict):
                return _quant_config_from(data, name, method)
    return None


@dataclass(frozen=True)
class Located:
    """Where a tensor of a (possibly sharded) checkpoint lives."""

    file: SafetensorsFile
    entry: TensorEntry
    display: str  # file path as reported


def _finding(loc: Located, tensor: str, check: str, message: str, *, count: int = 1,
             first_index: int | None = None, example: float | int | None = None,
             total: int | None = None) -> Finding:
    return Finding(file=loc.display, tensor=tensor, check=check, severity=CHECKS[check][0],
                   count=count, first_index=first_index, example=example, total=total,
                   message=message)


def _first(mask: np.ndarray, values: np.ndarray) -> tuple[int, int, int]:
    flat = mask.reshape(-1)
    i = int(np.argmax(flat))
    return int(np.count_nonzero(flat)), i, int(values.reshape(-1)[i])


class _Checker:
    def __init__(self, index: dict[str, Located], config: QuantConfig | None,
                 complete: bool) -> None:
        self.index = index
        self.config = config or QuantConfig()
        self.complete = complete
        self.findings: list[Finding] = []
        self.skipped: list[Skipped] = []
        self.methods: set[str] = set()

    def add(self, *args: Any, **kwargs: Any) -> None:
        self.findings.append(_finding(*args, **kwargs))

    # -- packed int (AWQ / GPTQ) ------------------------------------------------------------

    def packed_module(self, prefix: str) -> None:
        cfg = self.config
        qw = self.index[f"{prefix}.qweight"]
        qz = self.index.get(f"{prefix}.qzeros")
        sc = self.index.get(f"{prefix}.scales")
        gi = self.index.get(f"{prefix}.g_idx")
        name = qw.entry.name
        bits = cfg.bits or 4
        if bits not in (2, 4, 8):
            self.skipped.append(Skipped(qw.display, name, f"structure not checked (bits={bits})"))
            return
        pf = 32 // bits
        if cfg.method == "awq" and cfg.version not in (None, "gemm"):
            self.skipped.append(Skipped(qw.display, name, f"structure not checked (AWQ version "
                                                          f"{cfg.version})"))
            return
        if cfg.method == "gptq" and cfg.checkpoint_format not in (None, "gptq", "gptq_v2"):
            self.skipped.append(Skipped(qw.display, name, f"structure not checked (GPTQ format "
                                                          f"{cfg.checkpoint_format})"))
            return
        for loc, role, allowed in ((qw, "qweight", _PACKED_DTYPES), (qz, "qzeros", _PACKED_DTYPES),
                                   (sc, "scales", _SCALE_DTYPES), (gi, "g_idx", _GIDX_DTYPES)):
            if loc is not None and loc.entry.dtype not in allowed:
                self.add(loc, loc.entry.name, "dtype",
                         f"{role} is {loc.entry.dtype}; expected one of {sorted(allowed)}")
                return
        if sc is None:
            if self.complete:
                self.add(qw, name, "missing_tensor", f"{prefix}.scales is missing: the packed "
                                                     f"weight cannot be dequantized")
            return
        if qz is None and self.complete and not (cfg.sym and cfg.method == "awq"):
            self.add(qw, name, "missing_tensor", f"{prefix}.qzeros is missing")
        for loc, ndim in ((qw, 2), (sc, 2), (qz, 2), (gi, 1)):
            if loc is not None and len(loc.entry.shape) != ndim:
                self.add(loc, loc.entry.name, "shape",
                         f"shape {list(loc.entry.shape)} is not {ndim}-D")
                return
        rows, cols = qw.entry.shape
        ngroups, n_out = sc.entry.shape
        method = cfg.method if cfg.method in ("awq", "gptq") else None
        if method is None:
            found = "gptq" if gi is not None else packed_method((rows, cols), (ngroups, n_out), bits)
            method = {"awq-gemm": "awq", "gptq": "gptq"}.get(found or "")
            if method is None:
                self.add(qw, name, "shape",
                         f"qweight {list(qw.entry.shape)} fits neither AWQ [K, N/{pf}] nor GPTQ "
                         f"[K/{pf}, N] for scales {list(sc.entry.shape)} (N = {n_out})")
                return
        self.methods.add(method)
        if method == "awq":
            k = rows
            if cols * pf != n_out:
                self.add(qw, name, "shape",
                         f"AWQ qweight {list(qw.entry.shape)} packs {cols} x {pf} = {cols * pf} "
                         f"output columns but scales {list(sc.entry.shape)} has N = {n_out}")
                return
        else:
            k = rows * pf
            if cols != n_out:
                self.add(qw, name, "shape",
                         f"GPTQ qweight {list(qw.entry.shape)} has N = {cols} columns but "
                         f"scales {list(sc.entry.shape)} has N = {n_out}")
                return
        self._groups(qw, name, method, k, ngroups, sc)
        if qz is not None:
            expect = (ngroups, n_out // pf)
            if n_out % pf or tuple(qz.entry.shape) != expect:
                self.add(qz, qz.entry.name, "shape",
                         f"qzeros {list(qz.entry.shape)} does not match [K/G, N/{pf}] = "
                         f"{list(expect)} (scales {list(sc.entry.shape)})")
            elif method == "gptq":
                self._gptq_zeros(qz, bits, pf)
        if gi is not None:
            self._g_idx(gi, k, ngroups)

    def _groups(self, qw: Located, name: str, method: str, k: int, ngroups: int,
                sc: Located) -> None:
        g = self.config.group_size
        if g is not None and g != -1 and g <= 0:
            g = None
        if g is None:
            if ngroups == 0 or k % ngroups:
                self.add(qw, name, "shape",
                         f"K = {k} input rows are not divisible into the {ngroups} groups of "
                         f"scales {list(sc.entry.shape)}")
            return
        if g == -1:
            expect = 1
        elif method == "awq":
            if k % g:
                self.add(qw, name, "shape",
                         f"qweight {list(qw.entry.shape)} has K = {k} input rows, not a multiple "
                         f"of group size {g}")
                return
            expect = k // g
        else:
            expect = math.ceil(k / g)
        if ngroups != expect:
            self.add(qw, name, "shape",
                     f"scales {list(sc.entry.shape)} has {ngroups} groups but K = {k} with group "
                     f"size {g} needs {expect}")

    def _g_idx(self, gi: Located, k: int, ngroups: int) -> None:
        name = gi.entry.name
        if tuple(gi.entry.shape) != (k,):
            self.add(gi, name, "shape", f"g_idx {list(gi.entry.shape)} should be [K] = [{k}]")
        values = gi.file.read_all(gi.entry).astype(np.int64)
        bad = (values < 0) | (values >= ngroups)
        if bad.any():
            count, i, v = _first(bad, values)
            self.add(gi, name, "g_idx_range",
                     f"{count} of {values.size} g_idx values fall outside [0, {ngroups}); first "
                     f"at flat index {i}, value {v} (kernels read scales/qzeros out of bounds)",
                     count=count, first_index=i, example=v, total=int(values.size))

    def _gptq_zeros(self, qz: Located, bits: int, pf: int) -> None:
        mask = (1 << bits) - 1
        nibbles = unpack_bits(qz.file.read_all(qz.entry).view(np.int32), bits, axis=-1)  # [K/G, N]
        v1 = self.config.checkpoint_format in (None, "gptq")
        name = qz.entry.name
        if self.config.sym:
            expect = gptq.sym_zero(bits, v2=not v1)
            bad = nibbles != expect
            if bad.any():
                count, i, v = _first(bad, nibbles)
                self.add(qz, name, "zero_point_sym",
                         f"{count} of {nibbles.size} zero points differ from {expect}, the stored "
                         f"midpoint of symmetric GPTQ {'v1 (z - 1)' if v1 else 'v2'}; first at "
                         f"unpacked index {i}, value {v}",
                         count=count, first_index=i, example=v, total=int(nibbles.size))
        elif v1:
            bad = nibbles == mask
            if bad.any():
                count, i, v = _first(bad, nibbles)
                self.add(qz, name, "zero_point_wrap",
                         f"{count} of {nibbles.size} zero points are stored as {mask}: GPTQ v1 "
                         f"stores z - 1, so z = 0 wrapped to -1 (and may have corrupted the "
                         f"neighbouring nibbles); first at unpacked index {i}",
                         count=count, first_index=i, example=v, total=int(nibbles.size))

    # -- FP8 ----------------------------------------------------------------------------------

    def fp8_module(self, weight: Located) -> None:
        name = weight.entry.name
        prefix = name[: -len(".weight")]
        sc = (self.index.get(f"{prefix}.weight_scale")
              or self.index.get(f"{prefix}.weight_scale_inv"))
        self.methods.add("fp8")
        if sc is None:
            if self.complete:
                self.add(weight, name, "missing_tensor",
                         f"{weight.entry.dtype} weight has no {prefix}.weight_scale(_inv)")
            return
        if sc.entry.dtype not in _SCALE_DTYPES | {"F8_E8M0"}:
            self.add(sc, sc.entry.name, "dtype", f"weight_scale is {sc.entry.dtype}")
            return
        shape = weight.entry.shape
        sshape = sc.entry.shape
        if len(shape) != 2 or math.prod(sshape) == 1:
            return
        n, k = shape
        wbs = self.config.weight_block_size
        if wbs is not None:
            expect = (math.ceil(n / wbs[0]), math.ceil(k / wbs[1]))
            if tuple(sshape) != expect:
                self.add(sc, sc.entry.name, "shape",
                         f"weight_scale {list(sshape)} does not match weight {list(shape)} with "
                         f"weight_block_size {list(wbs)}: expected {list(expect)}")
            return
        if tuple(sshape) in ((n,), (n, 1)):
            return
        if len(sshape) == 2 and all(sshape):
            bn, bk = math.ceil(n / sshape[0]), math.ceil(k / sshape[1])
            if math.ceil(n / bn) == sshape[0] and math.ceil(k / bk) == sshape[1]:
                return
        self.add(sc, sc.entry.name, "shape",
                 f"weight_scale {list(sshape)} fits neither per-tensor, per-channel [{n}] nor a "
                 f"block layout of weight {list(shape)}")


def check_layout(index: dict[str, Located], config: QuantConfig | None, *,
                 complete: bool) -> tuple[str, list[Finding], list[Skipped]]:
    """Structural checks of one checkpoint. Returns (layout name, findings, skipped).

    `complete` says the index holds the whole checkpoint, so a missing companion tensor is a
    finding rather than one that lives in a shard not being scanned.
    """
    checker = _Checker(index, config, complete)
    names: Iterable[str] = sorted(index)
    for name in names:
        if name.endswith(".qweight"):
            checker.packed_module(name[: -len(".qweight")])
        elif name.endswith(".weight") and index[name].entry.dtype.startswith("F8_"):
            checker.fp8_module(index[name])
    if config is not None and config.method:
        layout = config.method
    elif checker.methods:
        layout = "+".join(sorted(checker.methods))
    else:
        layout = "plain"
    return layout, checker.findings, checker.skipped
