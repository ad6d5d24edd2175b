"""Weight layouts a replay understands: each one says whether it can take a snapshot, and why not.

A layout adapter turns the tensors a quantized layer really holds into the float64 weight
``W[K, N]`` and, for W8A8 schemes, the input as the kernel sees it after activation
quantization. That pair is the float64 reference a kernel is judged against. Every adapter
answers ``can_take(tensors, meta) -> (ok, reason)`` before anything runs (the shape of vLLM's
``MPLinearKernel.can_implement``); a layout nobody can take is refused with the reasons, never
guessed. All arithmetic is numpy: no torch.

Layouts (``LAYOUTS``):

- ``dense``: ``weight`` float ``[N, K]`` (torch Linear).
- ``awq-gemm``: AutoAWQ / vLLM checkpoint layout, ``qweight`` int32 ``[K, N/8]`` with nibble
  order ``[0, 2, 4, 6, 1, 3, 5, 7]``, ``qzeros`` ``[K/G, N/8]`` packed alike, ``scales``
  ``[K/G, N]``. ``W = (q - z) * s``.
- ``gptq``: ``qweight`` int32 ``[K/8, N]`` packed sequentially along K, ``qzeros`` int32
  ``[K/G, N/8]`` packed sequentially along N, ``scales`` ``[K/G, N]``, optional ``g_idx`` ``[K]``
  (act-order). GPTQ v1 checkpoints store ``zero - 1`` (``zero_plus_one``, the default); v2 does not.
- ``ct-pack-quantized``: compressed-tensors ``weight_packed`` int32 ``[N, K/8]`` (8 signed int4
  values per word, stored +8, sequential), ``weight_scale`` ``[N, K/G]``, optional
  ``weight_zero_point`` int32 ``[ceil(N/8), K/G]`` packed alike along N. ``W = (q - z) * s``.
- ``fp8``: ``weight`` stored as uint8 bit patterns of ``float8_e4m3fn``/``float8_e5m2`` ``[N, K]``,
  ``weight_scale`` scalar, per-channel ``[N]`` / ``[N, 1]``, or block ``[ceil(N/bn), ceil(K/bk)]``;
  ``input_scale`` static (a scalar) or dynamic (absent); the input is quantized to e4m3 as a W8A8
  kernel does (saturating unless ``meta['saturate']`` is False).
- ``vllm-cpu-w4a16``: what vLLM's CPU W4A16 kernel holds after loading an AWQ/GPTQ checkpoint:
  ``qweight`` int32 ``[N/16, 2K]`` (per 16-column block, K rows of 2 words packed sequentially
  along N), ``scales`` ``[K/G, N]``, ``qzeros`` ``[K/G, N/8]`` packed sequentially along N (AWQ
  zero points; absent for GPTQ's uint4b8, zero 8). ``W = (q - z) * s``.
- ``qforensics-fakequant``: the project's own fake-quant layer (a FIXTURE, never a user's kernel):
  dense weight plus an activation scheme string such as ``fp8-e4m3-nosat``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from qforensics.replay import awq
from qforensics.replay.fp8bits import (
    FP8_DECODE,
    FP8_MAX,
    decode_fp8,
    encode_fp8,
    quantize_fp8,
)

__all__ = ["FP8_MAX", "LAYOUTS", "Layout", "LayoutError", "choose_layout", "decode_fp8", "encode_fp8",
           "quantize_fp8", "unpack_sequential", "pack_sequential"]

class LayoutError(ValueError):
    """A snapshot's tensors contradict the layout they claim (shape, dtype, packing)."""


@dataclass(frozen=True)
class Layout:
    """One weight layout: what it needs, whether it can take a snapshot, and its reference."""

    name: str
    required: tuple[str, ...]
    check: Callable[[dict[str, np.ndarray], dict[str, Any]], str | None]
    dequantize: Callable[[dict[str, np.ndarray], dict[str, Any]], np.ndarray]
    input_as_seen: Callable[[np.ndarray, dict[str, np.ndarray], dict[str, Any]], np.ndarray] | None = None
    fixture: bool = False

    def can_take(self, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> tuple[bool, str]:
        missing = [n for n in self.required if n not in tensors]
        if missing:
            return False, f"{self.name}: missing {', '.join(missing)}"
        try:
            why = self.check(tensors, meta)
        except (LayoutError, ValueError, TypeError, KeyError) as exc:
            why = str(exc)
        return (why is None), (f"{self.name}: {why}" if why else f"{self.name}: ok")

    def weight_kn(self, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> np.ndarray:
        """The float64 weight [K, N]; corrupt parameters give NaN/Inf entries, silently."""
        with np.errstate(invalid="ignore", over="ignore"):
            return self.dequantize(tensors, meta)

    def effective_input(self, x: np.ndarray, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> np.ndarray:
        x64 = np.asarray(x, dtype=np.float64)
        return x64 if self.input_as_seen is None else self.input_as_seen(x64, tensors, meta)


def _k(meta: dict[str, Any]) -> int:
    return int(meta["K"])


def _group(meta: dict[str, Any], k: int) -> int:
    g = int(meta.get("group_size") or -1)
    return k if g == -1 else g


def _group_rows_mismatch(rows: int, meta: dict[str, Any]) -> str | None:
    """Why `rows` groups of scales cannot cover K with the stated group size (None: they can)."""
    k = _k(meta)
    g = _group(meta, k)
    if rows != math.ceil(k / g):
        return f"{rows} scale rows, but K={k} with group_size={g} needs {math.ceil(k / g)}"
    return None


def _is_int(a: np.ndarray) -> bool:
    return a.dtype.kind in "iu"


# -- dense ----------------------------------------------------------------------------------

def _dense_check(t: dict[str, np.ndarray], meta: dict[str, Any]) -> str | None:
    w = t["weight"]
    if w.ndim != 2 or w.dtype.kind != "f":
        return f"weight must be a float [N, K] array, got {w.dtype} {w.shape}"
    if w.shape[1] != _k(meta):
        return f"weight has {w.shape[1]} columns, the input has K={_k(meta)}"
    return None


def _dense_w(t: dict[str, np.ndarray], meta: dict[str, Any]) -> np.ndarray:
    return t["weight"].astype(np.float64).T


# -- AWQ GEMM -------------------------------------------------------------------------------

def _awq_check(t: dict[str, np.ndarray], meta: dict[str, Any]) -> str | None:
    qw, qz, sc = t["qweight"], t["qzeros"], t["scales"]
    k = _k(meta)
    if not (_is_int(qw) and _is_int(qz)) or sc.dtype.kind != "f":
        return "qweight/qzeros must be int32 words and scales float"
    if qw.ndim != 2 or qz.ndim != 2 or sc.ndim != 2:
        return "qweight, qzeros and scales must be 2-D"
    if qw.shape[0] != k:
        if qw.shape[0] * 8 == k:
            return f"qweight {qw.shape} is [K/8, N]: that is the GPTQ layout, not AWQ's [K, N/8]"
        return f"qweight has {qw.shape[0]} rows, the input has K={k}"
    n = qw.shape[1] * 8
    if sc.shape[1] != n or qz.shape[1] * 8 != n:
        return f"scales {sc.shape} / qzeros {qz.shape} do not match N={n} from qweight {qw.shape}"
    return None if "g_idx" in t else _group_rows_mismatch(sc.shape[0], meta)


def _awq_w(t: dict[str, np.ndarray], meta: dict[str, Any]) -> np.ndarray:
    return awq.dequantize(t["qweight"], t["qzeros"], t["scales"], _group(meta, _k(meta)), t.get("g_idx"))


# -- GPTQ -----------------------------------------------------------------------------------

def unpack_sequential(words: np.ndarray, axis: int) -> np.ndarray:
    """int32 words holding 8 nibbles each (nibble i = element 8w+i) -> values, unpacked along axis."""
    w = np.asarray(words).astype(np.int64) & 0xFFFFFFFF
    vals = (w[..., None] >> (4 * np.arange(8))) & 0xF  # [..., 8]
    vals = np.moveaxis(vals, -1, axis + 1)
    shape = list(w.shape)
    shape[axis] *= 8
    return vals.reshape(shape)


def pack_sequential(values: np.ndarray, axis: int) -> np.ndarray:
    """Inverse of unpack_sequential: values 0..15 packed 8 per int32 along axis."""
    v = np.moveaxis(np.asarray(values).astype(np.int64), axis, -1)
    if v.shape[-1] % 8:
        raise LayoutError(f"cannot pack {v.shape[-1]} values 8 per word")
    v = v.reshape(*v.shape[:-1], -1, 8)
    words = (v << (4 * np.arange(8))).sum(axis=-1)
    return np.moveaxis(words.astype(np.uint32).view(np.int32), -1, axis)


def _gptq_check(t: dict[str, np.ndarray], meta: dict[str, Any]) -> str | None:
    qw, qz, sc = t["qweight"], t["qzeros"], t["scales"]
    k = _k(meta)
    if not (_is_int(qw) and _is_int(qz)) or sc.dtype.kind != "f":
        return "qweight/qzeros must be int32 words and scales float"
    if qw.ndim != 2 or qw.shape[0] * 8 != k:
        return f"qweight {qw.shape} is not [K/8={k // 8}, N]"
    n = qw.shape[1]
    if sc.ndim != 2 or sc.shape[1] != n or qz.ndim != 2 or qz.shape[1] * 8 != n:
        return f"scales {sc.shape} / qzeros {qz.shape} do not match N={n}"
    if qz.shape[0] != sc.shape[0]:
        return f"qzeros has {qz.shape[0]} groups, scales {sc.shape[0]}"
    g_idx = t.get("g_idx")
    if g_idx is not None:
        g = np.asarray(g_idx).reshape(-1)
        if g.size != k:
            return f"g_idx has {g.size} entries, K={k}"
        if g.size and (g.min() < 0 or g.max() >= sc.shape[0]):
            return f"g_idx holds groups outside 0..{sc.shape[0] - 1} (min {g.min()}, max {g.max()})"
        return None
    return _group_rows_mismatch(sc.shape[0], meta)


def _gptq_w(t: dict[str, np.ndarray], meta: dict[str, Any]) -> np.ndarray:
    k = _k(meta)
    q = unpack_sequential(t["qweight"], 0).astype(np.float64)  # [K, N]
    z = unpack_sequential(t["qzeros"], 1).astype(np.float64)  # [G, N]
    if meta.get("zero_plus_one", True):
        z = z + 1.0
    s = t["scales"].astype(np.float64)
    g = awq.group_index(k, _group(meta, k), t.get("g_idx"))
    return (q - z[g]) * s[g]


# -- compressed-tensors pack-quantized ------------------------------------------------------

def _ct_check(t: dict[str, np.ndarray], meta: dict[str, Any]) -> str | None:
    wp, ws = t["weight_packed"], t["weight_scale"]
    k = _k(meta)
    if not _is_int(wp) or wp.ndim != 2 or wp.shape[1] * 8 != k:
        return f"weight_packed {wp.dtype} {wp.shape} is not int32 [N, K/8={k // 8}]"
    n = wp.shape[0]
    if ws.ndim != 2 or ws.shape[0] != n:
        return f"weight_scale {ws.shape} is not [N={n}, K/G]"
    zp = t.get("weight_zero_point")
    if zp is not None and (zp.ndim != 2 or zp.shape[1] != ws.shape[1] or zp.shape[0] * 8 < n):
        return f"weight_zero_point {zp.shape} does not pack [N={n}, {ws.shape[1]}] along N"
    return None


def _ct_w(t: dict[str, np.ndarray], meta: dict[str, Any]) -> np.ndarray:
    k = _k(meta)
    q = unpack_sequential(t["weight_packed"], 1).astype(np.float64) - 8.0  # [N, K] signed
    s = t["weight_scale"].astype(np.float64)
    n = q.shape[0]
    g = np.arange(k) // _group(meta, k) if s.shape[1] > 1 else np.zeros(k, np.int64)
    zp = t.get("weight_zero_point")
    z = 0.0 if zp is None else (unpack_sequential(zp, 0)[:n].astype(np.float64) - 8.0)[:, g]
    return ((q - z) * s[:, g]).T


# -- FP8 ------------------------------------------------------------------------------------

def _fp8_dtype(meta: dict[str, Any]) -> str:
    return str(meta.get("weight_dtype") or "float8_e4m3fn")


def _fp8_check(t: dict[str, np.ndarray], meta: dict[str, Any]) -> str | None:
    w, ws = t["weight"], t["weight_scale"]
    if w.dtype != np.uint8 or w.ndim != 2:
        return f"weight must hold FP8 bit patterns as uint8 [N, K], got {w.dtype} {w.shape}"
    if _fp8_dtype(meta) not in FP8_DECODE:
        return f"weight_dtype {_fp8_dtype(meta)!r} is not an FP8 format"
    n, k = w.shape
    if k != _k(meta):
        return f"weight has {k} columns, the input has K={_k(meta)}"
    block = meta.get("weight_block_size")
    if ws.size in (1, n):
        return None
    if block and ws.ndim == 2 and ws.shape == (math.ceil(n / block[0]), math.ceil(k / block[1])):
        return None
    return f"weight_scale {ws.shape} is neither per-tensor, per-channel [N={n}] nor a block grid for {block}"


def _fp8_w(t: dict[str, np.ndarray], meta: dict[str, Any]) -> np.ndarray:
    w = decode_fp8(t["weight"], _fp8_dtype(meta))
    ws = t["weight_scale"].astype(np.float64)
    n, k = w.shape
    if ws.size == 1:
        s = ws.reshape(())
    elif ws.size == n:
        s = ws.reshape(n, 1)
    else:
        bn, bk = meta["weight_block_size"]
        s = np.repeat(np.repeat(ws, bn, axis=0)[:n], bk, axis=1)[:, :k]
    return (w * s).T


def _fp8_input(x: np.ndarray, t: dict[str, np.ndarray], meta: dict[str, Any]) -> np.ndarray:
    dt = str(meta.get("input_dtype_q") or "float8_e4m3fn")
    top = FP8_MAX[dt]
    if "input_scale" in t:
        scale = float(np.asarray(t["input_scale"], dtype=np.float64).reshape(-1)[0])
    else:  # dynamic per-token scales, as vLLM's dynamic FP8 does
        amax = np.nanmax(np.abs(np.where(np.isfinite(x), x, 0.0)), axis=-1, keepdims=True)
        scale = np.where(amax > 0, amax / top, 1.0)
    return quantize_fp8(x / scale, dt, saturate=bool(meta.get("saturate", True))) * scale


# -- vLLM's CPU W4A16 (CPUWNA16LinearKernel) after process_weights_after_loading -----------

def _vllm_cpu_q(t: dict[str, np.ndarray], meta: dict[str, Any]) -> np.ndarray:
    """Undo vLLM's CPU W4A16 repack: qweight [N/16, 2K] holds, for each block of 16 output
    columns, K rows of 2 words packed sequentially along N. Returns q [K, N]."""
    k = _k(meta)
    qw = np.asarray(t["qweight"])
    blocks = qw.shape[0]
    words = qw.reshape(blocks, k, 2).transpose(1, 0, 2).reshape(k, blocks * 2)
    return unpack_sequential(words, 1)


def _vllm_cpu_check(t: dict[str, np.ndarray], meta: dict[str, Any]) -> str | None:
    qw, sc = t["qweight"], t["scales"]
    k = _k(meta)
    if not _is_int(qw) or qw.ndim != 2 or qw.shape[1] != 2 * k:
        return f"qweight {qw.dtype} {qw.shape} is not vLLM's CPU W4A16 repack [N/16, 2K={2 * k}]"
    n = qw.shape[0] * 16
    if sc.dtype.kind != "f" or sc.ndim != 2 or sc.shape[1] != n:
        return f"scales {sc.shape} do not match N={n}"
    zp = t.get("qzeros")
    if zp is not None and (zp.ndim != 2 or zp.shape != (sc.shape[0], n // 8)):
        return f"qzeros {zp.shape} is not [groups={sc.shape[0]}, N/8={n // 8}]"
    return _group_rows_mismatch(sc.shape[0], meta)


def _vllm_cpu_w(t: dict[str, np.ndarray], meta: dict[str, Any]) -> np.ndarray:
    k = _k(meta)
    q = _vllm_cpu_q(t, meta).astype(np.float64)
    z = unpack_sequential(t["qzeros"], 1).astype(np.float64) if t.get("qzeros") is not None else 8.0  # uint4b8
    s = t["scales"].astype(np.float64)
    g = np.arange(k) // _group(meta, k)
    return (q - (z[g] if isinstance(z, np.ndarray) else z)) * s[g]


# -- the project's own fake-quant layer (fixture) -------------------------------------------

_FAKE_RE = re.compile(r"^fp8-(e4m3|e4m3fn|e5m2)((?:-(?:nosat|dynamic))*)$")


def _fake_check(t: dict[str, np.ndarray], meta: dict[str, Any]) -> str | None:
    why = _dense_check(t, meta)
    if why:
        return why
    fmt = str(meta.get("fake_quant") or "")
    if not _FAKE_RE.match(fmt):
        return f"activation scheme {fmt!r} has no float64 reference here (known: fp8-e4m3|e5m2[-nosat][-dynamic])"
    return None


def _fake_input(x: np.ndarray, t: dict[str, np.ndarray], meta: dict[str, Any]) -> np.ndarray:
    m = _FAKE_RE.match(str(meta["fake_quant"]))
    assert m is not None  # can_take checked it
    dt = "float8_e5m2" if m.group(1) == "e5m2" else "float8_e4m3fn"
    mods = m.group(2)
    scale = 1.0
    if "dynamic" in mods:
        amax = float(np.nanmax(np.abs(np.where(np.isfinite(x), x, 0.0)))) if x.size else 0.0
        scale = amax / FP8_MAX[dt] if amax > 0 else 1.0
    return quantize_fp8(x / scale, dt, saturate="nosat" not in mods) * scale


LAYOUTS: dict[str, Layout] = {
    "dense": Layout("dense", ("weight",), _dense_check, _dense_w),
    "awq-gemm": Layout("awq-gemm", ("qweight", "qzeros", "scales"), _awq_check, _awq_w),
    "gptq": Layout("gptq", ("qweight", "qzeros", "scales"), _gptq_check, _gptq_w),
    "ct-pack-quantized": Layout("ct-pack-quantized", ("weight_packed", "weight_scale"), _ct_check, _ct_w),
    "fp8": Layout("fp8", ("weight", "weight_scale"), _fp8_check, _fp8_w, _fp8_input),
    "vllm-cpu-w4a16": Layout("vllm-cpu-w4a16", ("qweight", "scales"), _vllm_cpu_check, _vllm_cpu_w),
    "qforensics-fakequant": Layout("qforensics-fakequant", ("weight",), _fake_check, _dense_w, _fake_input,
                                   fixture=True),
}

# Layouts that are repacked at load by an engine: refused with the reason (never read as AWQ).
REPACKED = {
    "marlin": "Marlin repacks INT4 weights into its own tile order at load",
    "exllama": "exllama shuffles GPTQ weights at load (post_init)",
    "machete": "Machete repacks weights into its own layout at load",
    "vllm-cpu-w4a8": ("vLLM's CPU W4A8 path (the default on AMX CPUs, VLLM_CPU_INT4_W4A8=1) blocks weights, scales "
                      "and zero points with convert_weight_packed_scale_zp; rerun with VLLM_CPU_INT4_W4A8=0 to get the "
                      "W4A16 layout replay reads"),
}


# Layouts whose tensors could be mistaken for another's: used only when the trace names them.
NAMED_ONLY = ("vllm-cpu-w4a16",)


def choose_layout(tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> Layout:
    """The layout named in meta['layout'] (checked), else the one whose tensors are present.

    Raises LayoutError with every adapter's reason when none can take the snapshot.
    """
    name = meta.get("layout")
    if name in REPACKED:
        raise LayoutError(f"layout {name!r} is refused: {REPACKED[name]}; record the checkpoint's tensors "
                          "before repacking (or replay the checkpoint's layer) instead")
    if name is not None and name not in LAYOUTS:
        raise LayoutError(f"unknown layout {name!r}; known: {', '.join(LAYOUTS)}")
    candidates = [LAYOUTS[name]] if name else list(LAYOUTS.values())
    reasons = []
    for lay in candidates:
        if (lay.fixture or lay.name in NAMED_ONLY) and name is None:
            continue  # chosen only when the trace names them
        ok, why = lay.can_take(tensors, meta)
        if ok:
            return lay
        reasons.append(why)
    raise LayoutError("no layout can take this snapshot: " + "; ".join(reasons))
