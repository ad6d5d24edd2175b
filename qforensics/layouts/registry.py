"""The layouts as checked adapters over a layer's tensors (numpy arrays) and its facts (`meta`).

Each `Layout` answers ``can_take(tensors, meta) -> reason`` ("" when it can; the shape of vLLM's
``MPLinearKernel.can_implement``) before anything is decoded, and gives the float weight
``W[K, N]`` and, for W8A8 schemes, the input as the kernel sees it. Facts in `meta`: ``K`` (the
input width), ``group_size`` (-1: one group), ``bits``, ``zero_plus_one`` (GPTQ v1, the default),
``weight_dtype`` / ``weight_block_size`` / ``input_dtype_q`` / ``saturate`` (FP8).

Tensor names are the checkpoints' own: ``weight``; ``qweight``/``qzeros``/``scales``/``g_idx``;
``weight_packed``/``weight_scale``/``weight_zero_point``/``weight_shape``; ``input_scale``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from qforensics.layouts import awq, compressed, fp8, gptq, vllm_cpu
from qforensics.layouts.bits import LayoutError, unpack_awq, unpack_bits

__all__ = ["LAYOUTS", "NAMED_ONLY", "REPACKED", "Layout", "int4_parts"]

Tensors = dict[str, np.ndarray]


@dataclass(frozen=True)
class Layout:
    """One weight layout: what it needs, whether it can take a layer, and its float weight."""

    name: str
    required: tuple[str, ...]
    check: Callable[[Tensors, dict[str, Any]], str | None]
    dequantize: Callable[[Tensors, dict[str, Any]], np.ndarray]
    input_as_seen: Callable[[np.ndarray, Tensors, dict[str, Any]], np.ndarray] | None = None
    fixture: bool = False

    def can_take(self, tensors: Tensors, meta: dict[str, Any]) -> str:
        """"" when this layout can take the tensors; else why not, prefixed with its name."""
        missing = [n for n in self.required if n not in tensors]
        if missing:
            return f"{self.name}: missing {', '.join(missing)}"
        try:
            why = self.check(tensors, meta)
        except (LayoutError, ValueError, TypeError, KeyError) as exc:
            why = str(exc) or type(exc).__name__
        return f"{self.name}: {why}" if why else ""

    def weight_kn(self, tensors: Tensors, meta: dict[str, Any]) -> np.ndarray:
        """The float64 weight [K, N]; corrupt parameters give NaN/Inf entries, silently."""
        with np.errstate(invalid="ignore", over="ignore"):
            return self.dequantize(tensors, meta)

    def effective_input(self, x: np.ndarray, tensors: Tensors, meta: dict[str, Any]) -> np.ndarray:
        x64 = np.asarray(x, dtype=np.float64)
        return x64 if self.input_as_seen is None else self.input_as_seen(x64, tensors, meta)


def _k(meta: dict[str, Any]) -> int:
    return int(meta["K"])


def _group(meta: dict[str, Any]) -> int | None:
    g = meta.get("group_size")
    return None if g is None else int(g)


def _groups_problem(rows: int, meta: dict[str, Any]) -> str | None:
    """Why `rows` groups of scales cannot cover K with the stated group size (None: they can)."""
    k, g = _k(meta), _group(meta)
    if not g or g < -1:  # not stated: the groups must split K evenly
        return None if rows and k % rows == 0 else f"K={k} does not divide into {rows} scale groups; state the group_size"
    need = 1 if g == -1 else -(-k // g)
    return None if rows == need else f"{rows} scale rows, but K={k} with group_size={g} needs {need}"


def _ints(*arrays: np.ndarray) -> bool:
    return all(a.dtype.kind in "iu" for a in arrays)


# -- dense ----------------------------------------------------------------------------------

def dense_check(t: Tensors, meta: dict[str, Any]) -> str | None:
    w = t["weight"]
    if w.ndim != 2 or w.dtype.kind != "f":
        return f"weight must be a float [N, K] array, got {w.dtype} {w.shape}"
    if w.shape[1] != _k(meta):
        return f"weight has {w.shape[1]} columns, the input has K={_k(meta)}"
    return None


def dense_w(t: Tensors, meta: dict[str, Any]) -> np.ndarray:
    return t["weight"].astype(np.float64).T


# -- AWQ GEMM, GPTQ ------------------------------------------------------------------------

def _packed_types(t: Tensors, words: tuple[str, ...], scale: str) -> str | None:
    if not _ints(*(t[n] for n in words if n in t)) or t[scale].dtype.kind != "f":
        return f"{'/'.join(words)} must be int32 words and {scale} float"
    return None


def _awq_check(t: Tensors, meta: dict[str, Any]) -> str | None:
    why = _packed_types(t, ("qweight", "qzeros"), "scales") or awq.shape_problem(
        t["qweight"].shape, t["qzeros"].shape, t["scales"].shape, _k(meta))
    return why or (None if "g_idx" in t else _groups_problem(t["scales"].shape[0], meta))


def _awq_w(t: Tensors, meta: dict[str, Any]) -> np.ndarray:
    return awq.dequantize(t["qweight"], t["qzeros"], t["scales"], _group(meta), t.get("g_idx"))


def _gptq_check(t: Tensors, meta: dict[str, Any]) -> str | None:
    gi = t.get("g_idx")
    why = _packed_types(t, ("qweight", "qzeros"), "scales") or gptq.shape_problem(
        t["qweight"].shape, t["qzeros"].shape, t["scales"].shape, int(meta.get("bits") or 4), _k(meta),
        None if gi is None else int(gi.size))
    if why or gi is None:
        return why or _groups_problem(t["scales"].shape[0], meta)
    g, rows = np.asarray(gi).reshape(-1), t["scales"].shape[0]
    if g.size and (g.min() < 0 or g.max() >= rows):
        return f"g_idx holds groups outside 0..{rows - 1} (min {g.min()}, max {g.max()})"
    return None


def _gptq_w(t: Tensors, meta: dict[str, Any]) -> np.ndarray:
    return gptq.dequantize(t["qweight"], t["qzeros"], t["scales"], int(meta.get("bits") or 4), _group(meta),
                           t.get("g_idx"), v2=not meta.get("zero_plus_one", True))


# -- compressed-tensors pack-quantized ------------------------------------------------------

def _ct_shape(t: Tensors, meta: dict[str, Any]) -> tuple[int, int]:
    if "weight_shape" in t:
        n, k = (int(v) for v in np.asarray(t["weight_shape"]).reshape(-1)[:2])
        return n, k
    return int(t["weight_packed"].shape[0]), _k(meta)


def _ct_check(t: Tensors, meta: dict[str, Any]) -> str | None:
    wp, ws = t["weight_packed"], t["weight_scale"]
    if not _ints(wp) or ws.dtype.kind != "f":
        return "weight_packed must be int32 words and weight_scale float"
    n, k = _ct_shape(t, meta)
    if k != _k(meta):
        return f"weight_shape says K={k}, the input has K={_k(meta)}"
    zp = t.get("weight_zero_point")
    return compressed.shape_problem(wp.shape, ws.shape, (n, k), int(meta.get("bits") or 4),
                                    None if zp is None else zp.shape)


def _ct_w(t: Tensors, meta: dict[str, Any]) -> np.ndarray:
    return compressed.dequantize(t["weight_packed"], t["weight_scale"], _ct_shape(t, meta),
                                 int(meta.get("bits") or 4), t.get("weight_zero_point"), _group(meta))


# -- FP8 ------------------------------------------------------------------------------------

def _fp8_dtype(meta: dict[str, Any]) -> str:
    return str(meta.get("weight_dtype") or "float8_e4m3fn")


def _block(meta: dict[str, Any]) -> tuple[int, int] | None:
    b = meta.get("weight_block_size")
    return (int(b[0]), int(b[1])) if b else None


def _fp8_check(t: Tensors, meta: dict[str, Any]) -> str | None:
    w, ws = t["weight"], t["weight_scale"]
    if w.dtype != np.uint8 or w.ndim != 2:
        return f"weight must hold FP8 bit patterns as uint8 [N, K], got {w.dtype} {w.shape}"
    if _fp8_dtype(meta) not in fp8.FP8_NAMES:
        return f"weight_dtype {_fp8_dtype(meta)!r} is not an FP8 format"
    n, k = w.shape
    if k != _k(meta):
        return f"weight has {k} columns, the input has K={_k(meta)}"
    kind = fp8.scale_kind(ws.shape, n, k, _block(meta))
    if kind is None or (kind == "block" and _block(meta) is None):
        return (f"weight_scale {ws.shape} is neither per-tensor, per-channel [N={n}] nor a block grid for "
                f"{meta.get('weight_block_size')}")
    return None


def _fp8_w(t: Tensors, meta: dict[str, Any]) -> np.ndarray:
    return fp8.dequantize_fp8(t["weight"], t["weight_scale"], _fp8_dtype(meta), _block(meta))


def _fp8_input(x: np.ndarray, t: Tensors, meta: dict[str, Any]) -> np.ndarray:
    dt = str(meta.get("input_dtype_q") or "float8_e4m3fn")
    top = fp8.FP8_MAX[dt]
    if "input_scale" in t:
        scale = float(np.asarray(t["input_scale"], dtype=np.float64).reshape(-1)[0])
    else:  # dynamic per-token scales, as vLLM's dynamic FP8 does
        amax = np.nanmax(np.abs(np.where(np.isfinite(x), x, 0.0)), axis=-1, keepdims=True)
        scale = np.where(amax > 0, amax / top, 1.0)
    return fp8.quantize_fp8(x / scale, dt, saturate=bool(meta.get("saturate", True))) * scale


# -- vLLM's CPU W4A16 -----------------------------------------------------------------------

def _vllm_cpu_check(t: Tensors, meta: dict[str, Any]) -> str | None:
    qw, sc, zp = t["qweight"], t["scales"], t.get("qzeros")
    if not _ints(qw) or sc.dtype.kind != "f":
        return f"qweight {qw.dtype} must be int32 words and scales float"
    why = vllm_cpu.shape_problem(qw.shape, sc.shape, None if zp is None else zp.shape, _k(meta))
    return why or _groups_problem(sc.shape[0], meta)


def _vllm_cpu_w(t: Tensors, meta: dict[str, Any]) -> np.ndarray:
    return vllm_cpu.dequantize(t["qweight"], t["scales"], _k(meta), t.get("qzeros"), _group(meta))


def int4_parts(name: str, t: Tensors, meta: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A 4-bit layout's unsigned codes q [K, N], zero points z [G, N] and scales s [G, N] as
    float64, with W[k, n] = (q - z[g(k)]) * s[g(k)] (what an int4 kernel is handed)."""
    if name == "awq-gemm":
        return (unpack_awq(t["qweight"]).astype(np.float64), unpack_awq(t["qzeros"]).astype(np.float64),
                t["scales"].astype(np.float64))
    if name == "gptq":
        z = unpack_bits(t["qzeros"], 4, axis=1).astype(np.float64)
        return (unpack_bits(t["qweight"], 4, axis=0).astype(np.float64),
                z + (1.0 if meta.get("zero_plus_one", True) else 0.0), t["scales"].astype(np.float64))
    if name == "ct-pack-quantized":  # codes stored +8; scales [N, K/G]
        q = unpack_bits(t["weight_packed"], 4, axis=1, count=_k(meta)).T.astype(np.float64)
        s = t["weight_scale"].astype(np.float64).T
        zp = t.get("weight_zero_point")
        z = (np.full_like(s, 8.0) if zp is None
             else unpack_bits(zp, 4, axis=0, count=q.shape[1]).T.astype(np.float64))
        return q, z, s
    raise LayoutError(f"{name} is not a 4-bit layout with codes, zero points and scales")


LAYOUTS: dict[str, Layout] = {
    "dense": Layout("dense", ("weight",), dense_check, dense_w),
    "awq-gemm": Layout("awq-gemm", ("qweight", "qzeros", "scales"), _awq_check, _awq_w),
    "gptq": Layout("gptq", ("qweight", "qzeros", "scales"), _gptq_check, _gptq_w),
    "ct-pack-quantized": Layout("ct-pack-quantized", ("weight_packed", "weight_scale"), _ct_check, _ct_w),
    "fp8": Layout("fp8", ("weight", "weight_scale"), _fp8_check, _fp8_w, _fp8_input),
    "vllm-cpu-w4a16": Layout("vllm-cpu-w4a16", ("qweight", "scales"), _vllm_cpu_check, _vllm_cpu_w),
}

# Layouts an engine repacks at load into something no adapter reads: refused with the reason.
REPACKED = {
    "marlin": "Marlin repacks INT4 weights into its own tile order at load",
    "exllama": "exllama shuffles GPTQ weights at load (post_init)",
    "machete": "Machete repacks weights into its own layout at load",
    "vllm-cpu-w4a8": ("vLLM's CPU W4A8 path (the default on AMX CPUs, VLLM_CPU_INT4_W4A8=1) blocks weights, scales "
                      "and zero points with convert_weight_packed_scale_zp; rerun with VLLM_CPU_INT4_W4A8=0 to get the "
                      "W4A16 layout replay reads"),
}

# Layouts whose tensors could be mistaken for another's: used only when they are named.
NAMED_ONLY = ("vllm-cpu-w4a16",)
