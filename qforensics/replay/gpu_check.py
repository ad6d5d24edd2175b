"""The GPU check: compute-sanitizer memcheck over real kernels on a recorded tile (needs a GPU).

    python -m qforensics.replay.gpu_check OUT_DIR [--trace T] [--sanitizer PATH] [--arch sm_90]

The recorded tile is the first non-finite call of a real SmolLM2 trace (default: the committed
sample_traces/fp8-e4m3-nosat-act.h5, model.layers.11.mlp.down_proj with channel 1229 at ~3,000).
Cases, each under `compute-sanitizer --tool memcheck`:

1. reference_kernel: the project's checked CUDA kernel on the tile (weight RTN-quantized to INT4
   g128) - expects 0 errors and agreement with the float64 reference;
2. torch_scaled_mm: torch._scaled_mm (FP8 e4m3 W8A8, per-tensor scales, static input scale 1.0)
   on the tile - numeric leg on CUDA against the float64 reference, then memcheck;
3. torch_int4pack_mm: torch's aten._weight_int4pack_mm (tinygemm) on the tile as AWQ INT4 g128 -
   numeric leg on CUDA, then memcheck;
3b. torch_compile_triton: the same tile through a torch.compile'd dequantize + matmul, i.e. the
   Triton kernels Inductor generates - numeric leg on CUDA, then memcheck;
4. planted_oob_fixture: the project's UNCHECKED build (a planted-bug fixture, not a user kernel) on
   3 of the tile's rows, fewer than its 8-row tile - expects KERNEL FAULT, a read past `x`.

Raw sanitizer output of every case and summary.json land flat in OUT_DIR (tests parse them).
Every case runs in a work folder of its own, with its own copy of its bundle (run_case).
Exit 0 when every expectation held, 1 otherwise. Each case is independent: one failing to run is
recorded with its error and the others still run.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from qforensics.jsondoc import write as write_json
from qforensics.layouts import awq
from qforensics.replay.build import build_bundle, build_bundle_from_trace
from qforensics.replay.bundle import Bundle, write_bundle
from qforensics.layouts.fp8 import FP8_MAX, encode_fp8, quantize_fp8
from qforensics.replay.judge import judge_numeric
from qforensics.replay.kernel import build_kernel, detect_arch, run_project_kernel
from qforensics.replay.run import sanitizer_leg
from qforensics.replay.torch_kernels import KERNELS
from qforensics.replay.verdict import Verdict, inconclusive

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "sample_traces" / "fp8-e4m3-nosat-act.h5"


def tile_bundles(trace: Path) -> dict[str, Bundle]:
    """The recorded tile in the three layouts the cases need (dense, fp8, awq-gemm)."""
    dense = build_bundle_from_trace(trace)
    x = dense.tensors["x"].astype(np.float32)
    w = dense.tensors["weight"].astype(np.float64)  # [N, K]
    base = {"call_index": dense.meta["call_index"], "module": dense.meta["module"], "source": str(trace)}
    ws = float(np.abs(w).max()) / FP8_MAX["float8_e4m3fn"]
    fp8 = build_bundle({"input.0": x, "weight": encode_fp8(quantize_fp8(w / ws)),
                        "weight_scale": np.array([ws], np.float32), "input_scale": np.array([1.0], np.float32)},
                       {**base, "layout": "fp8", "weight_dtype": "float8_e4m3fn", "kernel": "torch-scaled-mm"})
    qw, qz, sc = awq.quantize_rtn(w.T, 128)
    int4 = build_bundle({"input.0": x, "qweight": qw, "qzeros": qz, "scales": sc},
                        {**base, "layout": "awq-gemm", "group_size": 128, "kernel": "torch-int4pack"})
    planted = build_bundle({"input.0": x[:3], "qweight": qw, "qzeros": qz, "scales": sc},
                           {**base, "layout": "awq-gemm", "group_size": 128})
    return {"dense": dense, "fp8": fp8, "int4": int4, "planted": planted}


def case_bundle(bundle: Bundle, work_dir: Path) -> Bundle:
    """A copy of `bundle` owned by one case: written to work_dir/bundle.h5, so no other case's
    clean-up can remove the file its launcher opens (the 2026-12-04 run's torch_compile_triton
    memcheck opened the int4pack case's bundle.h5 from a folder already removed)."""
    own = dataclasses.replace(bundle, tensors=dict(bundle.tensors), meta=dict(bundle.meta), path=None,
                              notes=list(bundle.notes))
    write_bundle(own, Path(work_dir) / "bundle.h5")
    return own


def run_case(name: str, expect: set[Verdict], fn: Any, *, out: Path, work_root: Path,
             summary: dict[str, Any]) -> bool:
    """One case in a work folder of its own (work_root/NAME), removed after the case and only
    then; its raw sanitizer outputs are copied flat into `out` first. Records the entry in
    summary["cases"][name] and prints it; returns whether every verdict was expected."""
    t1 = time.time()
    entry: dict[str, Any] = {"expected": sorted(v.value for v in expect)}
    work = Path(work_root) / name
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    entry["work_dir"] = str(work)
    try:
        results = fn(work)
        entry["results"] = [r.to_dict() for r in results]
        entry["lines"] = [r.line() for r in results]
        entry["passed"] = all(r.verdict in expect for r in results)
        for raw in work.rglob("sanitizer-*.txt"):
            shutil.copy(raw, out / f"{name}.{raw.name}")
    except Exception:
        entry["error"] = traceback.format_exc()[-3000:]
        entry["passed"] = False
    finally:
        shutil.rmtree(work, ignore_errors=True)
    entry["seconds"] = round(time.time() - t1, 2)
    summary.setdefault("cases", {})[name] = entry
    sys.stdout.write(f"{'PASS' if entry['passed'] else 'FAIL'} {name} ({entry['seconds']} s)\n")
    for line in entry.get("lines", []) or [entry.get("error", "")[-600:]]:
        sys.stdout.write(f"    {line}\n")
    sys.stdout.flush()
    return bool(entry["passed"])


def torch_case(bundle: Bundle, kernel: str, *, sanitizer: str | None, timeout: float,
               device: str = "cuda") -> Any:
    """A case's body: `kernel`'s CUDA launch under memcheck on the case's own copy of `bundle`,
    then its numeric leg on `device` judged by the kernel's bound model (replay/bounds.py)."""
    def run(work: Path) -> list[Any]:
        b = case_bundle(bundle, work)  # this case's own bundle.h5, in this case's folder
        san = sanitizer_leg(b, kernel=kernel, launcher=None, work_dir=work, tool="memcheck", sanitizer=sanitizer,
                            kernel_name=None, print_limit=100, timeout=timeout)
        label = f"{kernel} ({device.upper()})"
        try:
            y = KERNELS[kernel].run(b.tensors, b.meta, b.layout, device)
            numeric = judge_numeric(b, y, label, kernel=kernel, device=device)
        except Exception as exc:  # recorded with the sanitizer result, which still counts
            numeric = inconclusive("kernel", f"{device.upper()} run failed", f"{kernel} on {device} raised {exc!r}"[:600])
        return [numeric, san]
    return run


def _tool_info(sanitizer: str | None) -> dict[str, Any]:
    info: dict[str, Any] = {}
    for key, argv in (("nvidia_smi", ["nvidia-smi", "-L"]), ("sanitizer", [sanitizer or "compute-sanitizer", "--version"])):
        try:
            info[key] = subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout.strip()[-400:]
        except (OSError, subprocess.SubprocessError) as exc:
            info[key] = f"unavailable: {exc}"
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda_device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception as exc:  # recorded, never fatal
        info["torch"] = f"unavailable: {exc}"
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qforensics.replay.gpu_check")
    p.add_argument("out_dir")
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--sanitizer", default=None)
    p.add_argument("--arch", default=None)
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per sanitizer run")
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"tools": _tool_info(args.sanitizer), "trace": args.trace, "cases": {}}
    arch = args.arch or detect_arch() or "sm_90"
    summary["arch"] = arch
    t0 = time.time()
    bundles = tile_bundles(Path(args.trace))
    for checked in (True, False):
        build_kernel(arch, checked=checked)
    summary["setup_s"] = round(time.time() - t0, 2)
    work_root = Path(tempfile.mkdtemp(prefix="qf-gpu-check-"))
    ok = True

    def case(name: str, expect: set[Verdict], fn: Any) -> None:
        nonlocal ok
        ok &= run_case(name, expect, fn, out=out, work_root=work_root, summary=summary)

    def reference(tmp: Path) -> list[Any]:
        res, _y = run_project_kernel(bundles["dense"], checked=True, work_dir=tmp, sanitizer=args.sanitizer,
                                     arch=arch, timeout=args.timeout)
        return [res]

    def planted(tmp: Path) -> list[Any]:
        res, _y = run_project_kernel(bundles["planted"], checked=False, work_dir=tmp, sanitizer=args.sanitizer,
                                     arch=arch, timeout=args.timeout, padding=4096)
        return [res]

    leg = {"sanitizer": args.sanitizer, "timeout": args.timeout}
    case("reference_kernel", {Verdict.NOT_REPRODUCED}, reference)
    case("torch_scaled_mm", {Verdict.NOT_REPRODUCED}, torch_case(bundles["fp8"], "torch-scaled-mm", **leg))
    case("torch_int4pack_mm", {Verdict.NOT_REPRODUCED}, torch_case(bundles["int4"], "torch-int4pack", **leg))
    case("torch_compile_triton", {Verdict.NOT_REPRODUCED}, torch_case(bundles["int4"], "torch-compile", **leg))
    case("planted_oob_fixture", {Verdict.KERNEL_FAULT}, planted)
    shutil.rmtree(work_root, ignore_errors=True)
    summary["total_s"] = round(time.time() - t0, 2)
    write_json(summary, out / "summary.json")
    return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
