"""Replay orchestration: bundle -> GPU run under compute-sanitizer and/or CPU emulation -> verdicts."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qforensics.errors import ReplayError
from qforensics.replay import kernel as kernel_mod
from qforensics.replay.bundle import (
    Bundle,
    build_bundle_from_trace,
    is_bundle,
    kernel_tensors,
    read_bundle,
)
from qforensics.replay.emulate import EmulationResult, LaunchGeometry, emulate_launch
from qforensics.replay.launcher import DONE_MARKER
from qforensics.replay.parse import attribute_buffers, parse_host_allocations
from qforensics.replay.sanitizer import (
    DEFAULT_PRINT_LIMIT,
    find_sanitizer,
    run_sanitizer,
    sanitizer_command,
)
from qforensics.replay.verdict import (
    ReplayResult,
    Verdict,
    inconclusive,
    judge_sanitizer,
    result_document,
)

PROJECT_KERNEL_FILTER = "kns=qf_awq_gemm"


def detect_gpu() -> tuple[bool, str]:
    """(available, how): /dev/nvidia[0-9]*, nvidia-smi -L, or torch.cuda.is_available()."""
    if glob.glob("/dev/nvidia[0-9]*"):
        return True, "/dev/nvidia* present"
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
            if out.returncode == 0 and "GPU" in out.stdout:
                return True, "nvidia-smi -L lists a GPU"
        except (OSError, subprocess.SubprocessError):
            pass
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch
        except ImportError:
            return False, "no /dev/nvidia*, no nvidia-smi, no torch"
    try:
        if torch.cuda.is_available():
            return True, "torch.cuda.is_available()"
    except Exception:  # a broken CUDA install is "no GPU" for our purpose
        pass
    return False, "no /dev/nvidia*, nvidia-smi lists no GPU, torch.cuda.is_available() is False"


@dataclass
class ReplayOutcome:
    bundle: Bundle
    results: list[ReplayResult] = field(default_factory=list)
    emulations: list[EmulationResult] = field(default_factory=list)

    def exit_code(self) -> int:
        """1 any CONFIRMED / EMULATED-with-errors; 3 only INCONCLUSIVE; else 0."""
        if any(r.failing for r in self.results):
            return 1
        if self.results and all(r.verdict is Verdict.INCONCLUSIVE for r in self.results):
            return 3
        return 0

    def document(self) -> dict[str, Any]:
        return result_document(self.results, bundle_path=str(self.bundle.path) if self.bundle.path else None,
                               meta=self.bundle.meta)


def load_bundle(source: str | os.PathLike[str], *, call: int | None = None, bundle_out: str | os.PathLike[str] | None = None,
                work_dir: Path | None = None, open_trace: Callable[[Any], Any] | None = None) -> Bundle:
    """A bundle file is read (and validated); a trace is turned into a bundle (written to bundle_out,
    else into work_dir)."""
    src = Path(source)
    if not src.exists():
        raise ReplayError(f"{src}: no such file")
    if is_bundle(src):
        if call is not None:
            raise ReplayError(f"{src} is already a replay bundle (one call); --call applies to traces only")
        return read_bundle(src)
    out = Path(bundle_out) if bundle_out else (work_dir or Path(tempfile.mkdtemp(prefix="qf-replay-"))) / "bundle.h5"
    return build_bundle_from_trace(src, out, call, open_trace=open_trace)


def emulate_bundle(bundle: Bundle, *, limit: int = 100) -> tuple[list[ReplayResult], list[EmulationResult]]:
    """Emulate the unchecked kernel on the bundle's tile (with numerics) and, when the bundle is a
    tile of a larger launch, the full launch's geometry."""
    data, ref, notes = kernel_tensors(bundle)
    g = int(bundle.meta["group_size"])
    tile = emulate_launch(LaunchGeometry.from_tensors(data, g), data=data, reference=ref, limit=limit)
    tile.notes[:0] = notes + list(bundle.notes)
    results = [_emulated("emulation", tile, f"tile rows [{bundle.meta.get('row_start', 0)}, {bundle.meta.get('row_stop', bundle.meta['M'])})")]
    emus = [tile]
    m_full = int(bundle.meta.get("M_full") or bundle.meta["M"])
    if m_full != int(bundle.meta["M"]):
        full = emulate_launch(LaunchGeometry.from_tensors(data, g, m=m_full), limit=limit)
        results.append(_emulated("emulation-full-launch", full, f"full launch M={m_full}"))
        emus.append(full)
    return results, emus


def _emulated(path: str, emu: EmulationResult, scope: str) -> ReplayResult:
    geo = emu.geometry
    shape = f"M={geo['M']} N={geo['N']} K={geo['K']} group_size={geo['group_size']}"
    grid = f"{emu.blocks_evaluated} of {emu.blocks_total} blocks" if emu.sampled else f"all {emu.blocks_total} blocks"
    num = ""
    if emu.numerics and emu.numerics.get("reference"):
        n = emu.numerics
        num = (f"; output equals the float64 reference on {n['compared']} in-bounds outputs"
               if not n["mismatches"] else
               f"; {n['mismatches']} of {n['compared']} in-bounds outputs differ from the float64 reference "
               f"(first at {n['first_mismatch']})")
    if emu.total_errors:
        first = emu.records[0]
        bufs = ", ".join(f"{b}: {s['count']}" for b, s in emu.by_buffer.items())
        summary = (f"{scope} ({shape}): {emu.total_errors} invalid accesses over {grid} ({bufs}); "
                   f"first: {first.describe()}{num}")
        return ReplayResult(Verdict.EMULATED, path, summary, first=first, errors=emu.total_errors, details=emu.to_dict())
    summary = f"{scope} ({shape}): 0 invalid accesses over {grid}{num}"
    if emu.analytic:
        summary += f"; analytic: {emu.analytic}"
    mism = (emu.numerics or {}).get("mismatches") or 0
    return ReplayResult(Verdict.EMULATED, path, summary, errors=mism, details=emu.to_dict())


def _padding_hint(emus: list[EmulationResult]) -> int:
    far = max((s.get("max_distance", 0) for e in emus[:1] for s in e.by_buffer.values()), default=0)
    return int(min(max(4096, (far + 16 + 4095) // 4096 * 4096), 64 << 20))


def run_gpu(bundle: Bundle, *, work_dir: Path, tool: str = "memcheck", sanitizer: str | None = None,
            launcher: str | None = None, kernel_name: str | None = None, print_limit: int = DEFAULT_PRINT_LIMIT,
            arch: str | None = None, timeout: float = 600, padding: int | None = None) -> ReplayResult:
    """Run the project kernel (or the user's launcher) on the bundle under compute-sanitizer."""
    path = "launcher" if launcher else "gpu"
    san = find_sanitizer(sanitizer)
    if san is None:
        return inconclusive(path, "no sanitizer", "compute-sanitizer not found (pass --sanitizer PATH, put it on PATH, "
                            "or pip install nvidia-cuda-sanitizer-api)")
    work_dir.mkdir(parents=True, exist_ok=True)
    if launcher:
        if bundle.path is None:
            raise ReplayError("a --launcher replay needs the bundle on disk (pass --bundle-out)")
        target = [sys.executable, "-m", "qforensics.replay.launcher", "--bundle", str(bundle.path),
                  "--launcher", launcher, "--out", str(work_dir / "launcher-out")]
        kfilter = kernel_name
    else:
        data, ref, _notes = kernel_tensors(bundle)
        exe = kernel_mod.build_kernel(arch or kernel_mod.detect_arch() or "sm_90", checked=False)
        kernel_mod.write_kernel_inputs(data, int(bundle.meta["group_size"]), work_dir / "kernel-in")
        target = [str(exe), str(work_dir / "kernel-in")]
        kfilter = kernel_name or PROJECT_KERNEL_FILTER
    argv = sanitizer_command(san, target, tool=tool, kernel_name=kfilter, print_limit=print_limit, padding=padding)
    run = run_sanitizer(argv, raw_path=work_dir / f"sanitizer-{tool}.txt", timeout=timeout)
    allocs = parse_host_allocations(run.report.host_lines)
    attribute_buffers(run.report, allocs)
    marker = DONE_MARKER if launcher else "qforensics-replay: kernel-done"
    ran = any(marker in line for line in run.report.host_lines)
    res = judge_sanitizer(run.report, kernel_ran=ran, print_limit=print_limit, path=path, timed_out=run.timed_out)
    res.details = {"sanitizer": run.to_dict(), "allocations": {k: [hex(a), s] for k, (a, s) in allocs.items()}}
    if not launcher and res.verdict is Verdict.NOT_REPRODUCED and ref is not None:
        y = kernel_mod.read_kernel_output(work_dir / "kernel-in", *ref.shape)
        if y is not None:
            with np.errstate(invalid="ignore"):
                err = np.abs(y.astype(np.float64) - ref)
            res.details["max_abs_err_vs_reference"] = float(np.nanmax(err)) if np.isfinite(err).any() else None
            res.details["nonfinite_outputs"] = int(np.count_nonzero(~np.isfinite(y)))
    return res


def replay(source: str | os.PathLike[str], *, call: int | None = None, bundle_out: str | os.PathLike[str] | None = None,
           mode: str = "auto", tool: str = "memcheck", sanitizer: str | None = None, launcher: str | None = None,
           kernel_name: str | None = None, print_limit: int = DEFAULT_PRINT_LIMIT, arch: str | None = None,
           work_dir: str | os.PathLike[str] | None = None, timeout: float = 600,
           open_trace: Callable[[Any], Any] | None = None,
           gpu_probe: Callable[[], tuple[bool, str]] = detect_gpu) -> ReplayOutcome:
    """mode: "auto" (GPU when present, emulation always), "gpu" (GPU only), "emulate" (CPU only)."""
    if mode not in ("auto", "gpu", "emulate"):
        raise ReplayError(f"mode must be auto, gpu or emulate, got {mode!r}")
    wd = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="qf-replay-"))
    bundle = load_bundle(source, call=call, bundle_out=bundle_out, work_dir=wd, open_trace=open_trace)
    outcome = ReplayOutcome(bundle)
    if mode != "gpu":
        results, emus = emulate_bundle(bundle, limit=print_limit or 100)
        outcome.emulations = emus
    if mode != "emulate":
        has_gpu, how = gpu_probe()
        if not has_gpu:
            outcome.results.append(inconclusive("launcher" if launcher else "gpu", "no GPU",
                                                f"GPU replay not run: no GPU ({how})"))
        else:
            pad = _padding_hint(outcome.emulations) if tool == "memcheck" else None
            outcome.results.append(run_gpu(bundle, work_dir=wd, tool=tool, sanitizer=sanitizer, launcher=launcher,
                                           kernel_name=kernel_name, print_limit=print_limit, arch=arch,
                                           timeout=timeout, padding=pad))
    if mode != "gpu":
        outcome.results.extend(results)
    return outcome
