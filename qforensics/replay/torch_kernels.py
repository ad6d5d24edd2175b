"""Kernels under judgement that torch provides: called on a bundle's tensors, on CPU or CUDA.

Each kernel is a small object that answers ``can_run(tensors, meta, layout) -> (ok, reason)``
before anything runs, and ``run(...) -> y[M, N]`` (float64 numpy) when it can. They take the
layout's float64 dequantized weight apart into the operands the torch op wants, so what is judged
is the op's own arithmetic and memory access on the recorded data, not our unpacking.

- ``torch-linear``: ``torch.nn.functional.linear`` in the dtype the run used (dense layers: the
  kernel an HF ``nn.Linear`` really calls).
- ``qforensics-fakequant``: the project's fake-quant layer's own forward (a FIXTURE's kernel).
- ``torch-int4pack``: ``aten._weight_int4pack_mm`` (CUDA, tinygemm) or
  ``_weight_int4pack_mm_for_cpu``, for 4-bit layouts with plain group order.
- ``torch-scaled-mm``: ``torch._scaled_mm`` for FP8 W8A8 with per-tensor scales.

The module-level ``cuda_int4pack_mm`` and ``cuda_scaled_mm`` are ``--launcher`` entry points
(``fn(tensors, meta)``) so compute-sanitizer can watch the CUDA ops in a child process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from qforensics.layouts.fp8 import FP8_MAX, quantize_fp8
from qforensics.layouts.registry import int4_parts
from qforensics.replay.layouts import LAYOUTS, Layout, choose_layout

INT4_LAYOUTS = ("awq-gemm", "gptq", "ct-pack-quantized")


def _torch() -> Any:
    import torch  # the capture side's dependency; replay's CPU kernels need it, the reference does not

    return torch


def cuda_matmul_flags() -> dict[str, bool]:
    """torch.backends.cuda.matmul's precision flags in this process (those a bound model reads:
    replay/bounds.py): {} without torch."""
    try:
        mm = _torch().backends.cuda.matmul
    except Exception:  # noqa: BLE001 - no torch: no flags
        return {}
    names = ("allow_tf32", "allow_fp16_reduced_precision_reduction",
             "allow_bf16_reduced_precision_reduction")
    return {n: bool(getattr(mm, n)) for n in names if hasattr(mm, n)}


def torch_available() -> tuple[bool, str]:
    try:
        torch = _torch()
    except ImportError as exc:
        return False, f"torch is not installed ({exc})"
    return True, f"torch {torch.__version__}"


def _dtype(name: str | None, default: str = "float32") -> Any:
    torch = _torch()
    dt = getattr(torch, str(name or default).replace("torch.", ""), None)
    return dt if isinstance(dt, torch.dtype) else getattr(torch, default)


@dataclass(frozen=True)
class TorchKernel:
    name: str
    op: str  # the torch op judged, as a user would search for it

    def can_run(self, tensors: dict[str, np.ndarray], meta: dict[str, Any], layout: Layout,
                device: str = "cpu") -> tuple[bool, str]:
        ok, why = torch_available()
        if not ok:
            return False, why
        return _CAN[self.name](tensors, meta, layout, device)

    def run(self, tensors: dict[str, np.ndarray], meta: dict[str, Any], layout: Layout,
            device: str = "cpu") -> np.ndarray:
        return _RUN[self.name](tensors, meta, layout, device)


# -- torch-linear ---------------------------------------------------------------------------

def _linear_can(t: dict[str, np.ndarray], meta: dict[str, Any], layout: Layout, device: str) -> tuple[bool, str]:
    if layout.name != "dense":
        return False, f"torch-linear runs dense weights; this layout is {layout.name}"
    return True, f"F.linear in {meta.get('compute_dtype') or 'float32'}"


def _linear_run(t: dict[str, np.ndarray], meta: dict[str, Any], layout: Layout, device: str) -> np.ndarray:
    torch = _torch()
    dt = _dtype(meta.get("compute_dtype"))
    x = torch.from_numpy(np.array(t["x"])).to(device=device, dtype=dt)
    w = torch.from_numpy(np.array(t["weight"])).to(device=device, dtype=dt)
    with torch.no_grad():
        y = torch.nn.functional.linear(x, w)
    return y.double().cpu().numpy()


# -- the project's fake-quant layer ---------------------------------------------------------

def _fake_can(t: dict[str, np.ndarray], meta: dict[str, Any], layout: Layout, device: str) -> tuple[bool, str]:
    if layout.name != "qforensics-fakequant":
        return False, "qforensics-fakequant runs only the project's own fake-quant fixture layer"
    try:
        from qforensics.quant import parse_scheme

        parse_scheme(str(meta.get("fake_quant")), "activations")
    except Exception as exc:  # the scheme string comes from an untrusted trace
        return False, f"scheme {meta.get('fake_quant')!r} is not one qforensics.quant knows ({exc})"
    return True, f"FakeQuantLinear.forward with {meta.get('fake_quant')}"


def _fake_run(t: dict[str, np.ndarray], meta: dict[str, Any], layout: Layout, device: str) -> np.ndarray:
    torch = _torch()
    from qforensics.quant import parse_scheme

    scheme = parse_scheme(str(meta["fake_quant"]), "activations")
    dt = _dtype(meta.get("compute_dtype"))
    x = torch.from_numpy(np.array(t["x"])).to(device=device, dtype=dt)
    w = torch.from_numpy(np.array(t["weight"])).to(device=device, dtype=dt)
    with torch.no_grad():
        y = torch.nn.functional.linear(scheme.fake_quant(x), w)
    return y.double().cpu().numpy()


# -- torch int4 (tinygemm) ------------------------------------------------------------------

def int4_qzs(t: dict[str, np.ndarray], meta: dict[str, Any], layout: Layout) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(q [K, N], z [G, N], s [G, N], group size) with W[k, n] = (q - z[g(k)]) * s[g(k)]."""
    k = int(meta["K"])
    g = int(meta.get("group_size") or k)
    q, z, s = int4_parts(layout.name, t, meta)
    return q, z, s, (k if g == -1 else g)


def int4_operands(t: dict[str, np.ndarray], meta: dict[str, Any], layout: Layout) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(q [N, K] 0..15, scale [K/G, N], zero [K/G, N]) in tinygemm's convention
    W[k, n] = (q - 8) * scale + zero: (q - z) * s == (q - 8) * s + (8 - z) * s."""
    q, z, s, g = int4_qzs(t, meta, layout)
    with np.errstate(invalid="ignore", over="ignore"):
        zero = (8.0 - z) * s
    return np.ascontiguousarray(q.T, dtype=np.int32), s, zero, g


def _int4_can(t: dict[str, np.ndarray], meta: dict[str, Any], layout: Layout, device: str) -> tuple[bool, str]:
    torch = _torch()
    if layout.name not in INT4_LAYOUTS:
        return False, f"torch-int4pack takes {', '.join(INT4_LAYOUTS)}; this layout is {layout.name}"
    if "g_idx" in t and not np.array_equal(np.asarray(t["g_idx"]).reshape(-1),
                                           np.arange(int(meta["K"])) // max(1, int(meta.get("group_size") or 1))):
        return False, "act-order g_idx: tinygemm has no group index, it cannot run this weight as stored"
    k, n = int(meta["K"]), int(meta["N"])
    g = int(meta.get("group_size") or k)
    if g not in (32, 64, 128, 256) or k % g:
        return False, f"group_size {g} with K={k}: tinygemm takes 32/64/128/256 dividing K"
    if n % 8 or k % 64:
        return False, f"N={n} (multiple of 8) and K={k} (multiple of 64) required"
    if device == "cuda" and not torch.cuda.is_available():
        return False, "no CUDA device"
    op = "_weight_int4pack_mm" if device == "cuda" else "_weight_int4pack_mm_for_cpu"
    if not hasattr(torch.ops.aten, op):
        return False, f"this torch ({torch.__version__}) has no aten.{op}"
    return True, f"aten.{op} (bf16 activations, group {g})"


def _int4_run(t: dict[str, np.ndarray], meta: dict[str, Any], layout: Layout, device: str) -> np.ndarray:
    torch = _torch()
    q, s, z, g = int4_operands(t, meta, layout)
    sz = torch.from_numpy(np.stack([s, z], axis=-1)).to(torch.bfloat16).contiguous()
    x = torch.from_numpy(np.array(t["x"])).to(torch.bfloat16)
    if device == "cuda":
        qt = torch.from_numpy(q.astype(np.uint8))
        packed_u8 = (qt[:, ::2] << 4 | qt[:, 1::2]).contiguous().cuda()
        packed = torch.ops.aten._convert_weight_to_int4pack(packed_u8, 2)
        y = torch.ops.aten._weight_int4pack_mm(x.cuda(), packed, g, sz.cuda())
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q), 2)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, g, sz)
    return y.double().cpu().numpy()


# -- torch._scaled_mm (FP8 W8A8) ------------------------------------------------------------

def _scaled_can(t: dict[str, np.ndarray], meta: dict[str, Any], layout: Layout, device: str) -> tuple[bool, str]:
    torch = _torch()
    if layout.name != "fp8":
        return False, f"torch-scaled-mm takes the fp8 layout; this layout is {layout.name}"
    if np.asarray(t["weight_scale"]).size != 1:
        return False, "torch-scaled-mm here runs per-tensor weight scales only"
    if device == "cuda" and not torch.cuda.is_available():
        return False, "no CUDA device"
    k, n = int(meta["K"]), int(meta["N"])
    if k % 16 or n % 16:
        return False, f"_scaled_mm needs K={k} and N={n} to be multiples of 16"
    return True, "torch._scaled_mm (e4m3 x e4m3, per-tensor scales, float32 out)"


def scaled_operands(t: dict[str, np.ndarray], meta: dict[str, Any]) -> tuple[np.ndarray, float, float]:
    """Input quantized as the layer does (static input_scale, else dynamic per-tensor)."""
    x = np.asarray(t["x"], dtype=np.float64)
    if "input_scale" in t:
        sa = float(np.asarray(t["input_scale"], dtype=np.float64).reshape(-1)[0])
    else:
        amax = float(np.nanmax(np.abs(np.where(np.isfinite(x), x, 0.0)))) if x.size else 0.0
        sa = amax / FP8_MAX["float8_e4m3fn"] if amax > 0 else 1.0
    xq = quantize_fp8(x / sa, "float8_e4m3fn", saturate=bool(meta.get("saturate", True)))
    sb = float(np.asarray(t["weight_scale"], dtype=np.float64).reshape(-1)[0])
    return xq, sa, sb


def _scaled_run(t: dict[str, np.ndarray], meta: dict[str, Any], layout: Layout, device: str) -> np.ndarray:
    torch = _torch()
    xq, sa, sb = scaled_operands(t, meta)
    a = torch.from_numpy(xq).to(torch.float32).to(torch.float8_e4m3fn).to(device)
    w = torch.from_numpy(np.array(t["weight"])).view(torch.float8_e4m3fn).to(device)
    scale_a = torch.tensor(sa, dtype=torch.float32, device=device)
    scale_b = torch.tensor(sb, dtype=torch.float32, device=device)
    y = torch._scaled_mm(a, w.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
    return y.double().cpu().numpy()


# -- torch.compile (Inductor: Triton kernels on CUDA, C++ on CPU) ---------------------------

def _dequant_mm(x: Any, q: Any, z: Any, s: Any, g: Any) -> Any:
    """The dequantize-then-matmul graph a torch.compile'd quantized linear runs."""
    return x @ ((q.float() - z.float()[g]) * s.float()[g])


_COMPILED: dict[str, Any] = {}


def _compiled_can(t: dict[str, np.ndarray], meta: dict[str, Any], layout: Layout, device: str) -> tuple[bool, str]:
    torch = _torch()
    if layout.name not in INT4_LAYOUTS:
        return False, f"torch-compile runs the 4-bit layouts {', '.join(INT4_LAYOUTS)}; this layout is {layout.name}"
    if device == "cuda" and not torch.cuda.is_available():
        return False, "no CUDA device"
    return True, f"torch.compile'd dequantize + matmul (Inductor: {'Triton' if device == 'cuda' else 'C++'} kernels)"


def _compiled_run(t: dict[str, np.ndarray], meta: dict[str, Any], layout: Layout, device: str) -> np.ndarray:
    torch = _torch()
    q, z, s, g = int4_qzs(t, meta, layout)
    k = int(meta["K"])
    groups = (np.asarray(t["g_idx"], np.int64).reshape(-1) if "g_idx" in t else np.arange(k) // g)
    fn = _COMPILED.setdefault(device, torch.compile(_dequant_mm, dynamic=False))
    args = [torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in
            (np.asarray(t["x"], np.float32), q.astype(np.int32), z.astype(np.float32),
             s.astype(np.float32), groups)]
    with torch.no_grad():
        y = fn(*args)
    return y.double().cpu().numpy()


_CAN = {"torch-linear": _linear_can, "qforensics-fakequant": _fake_can, "torch-int4pack": _int4_can,
        "torch-scaled-mm": _scaled_can}
_CAN["torch-compile"] = _compiled_can
_RUN = {"torch-linear": _linear_run, "qforensics-fakequant": _fake_run, "torch-int4pack": _int4_run,
        "torch-scaled-mm": _scaled_run}
def _vllm(name: str) -> Any:
    from qforensics.replay import vllm_kernels

    return getattr(vllm_kernels, name)


_RUN["torch-compile"] = _compiled_run
_CAN["vllm-cpu-wna16"] = lambda *a: _vllm("_wna16_can")(*a)
_RUN["vllm-cpu-wna16"] = lambda *a: _vllm("_wna16_run")(*a)
KERNELS: dict[str, TorchKernel] = {
    "torch-linear": TorchKernel("torch-linear", "torch.nn.functional.linear"),
    "qforensics-fakequant": TorchKernel("qforensics-fakequant", "qforensics FakeQuantLinear.forward (fixture)"),
    "torch-int4pack": TorchKernel("torch-int4pack", "torch.ops.aten._weight_int4pack_mm[_for_cpu]"),
    "torch-scaled-mm": TorchKernel("torch-scaled-mm", "torch._scaled_mm"),
    "torch-compile": TorchKernel("torch-compile", "torch.compile'd dequantize + matmul (Inductor Triton/C++)"),
    "vllm-cpu-wna16": TorchKernel("vllm-cpu-wna16", "vllm._custom_ops.cpu_gemm_wna16"),
}


# -- --launcher entry points for the GPU check (run in a child under compute-sanitizer) ------

def _launch(name: str, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> Any:
    layout = LAYOUTS[meta["layout"]] if meta.get("layout") in LAYOUTS else choose_layout(tensors, meta)
    kernel = KERNELS[name]
    ok, why = kernel.can_run(tensors, meta, layout, "cuda")
    if not ok:
        raise RuntimeError(f"{name} cannot run this bundle on CUDA: {why}")
    return kernel.run(tensors, meta, layout, "cuda")


def cuda_int4pack_mm(tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> Any:
    return _launch("torch-int4pack", tensors, meta)


def cuda_scaled_mm(tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> Any:
    return _launch("torch-scaled-mm", tensors, meta)


def cuda_compiled_dequant_mm(tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> Any:
    return _launch("torch-compile", tensors, meta)
