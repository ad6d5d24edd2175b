"""Build the project's replay kernel with nvcc (cached) and talk to its host program.

The host program (kernels/awq_gemm.cu) reads DIR/header.txt and raw little-endian DIR/*.bin
files that `write_kernel_inputs` writes; HDF5 stays on the Python side. Binaries are cached
under the user cache dir, keyed by source hash, nvcc version, arch and checked/unchecked.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from qforensics.atomic import replacing
from qforensics.cachedir import cache_root
from qforensics.errors import ReplayError

KERNEL_SOURCE = Path(__file__).parent / "kernels" / "awq_gemm.cu"
HEADER_MAGIC = "qforensics-replay-bin 1"
_FILES = {"x": ("x.bin", np.float16), "qweight": ("qweight.bin", np.int32), "qzeros": ("qzeros.bin", np.int32),
          "scales": ("scales.bin", np.float16), "g_idx": ("g_idx.bin", np.int32)}


def cache_dir() -> Path:
    """The cache root (qforensics/cachedir.py) + /replay."""
    return cache_root() / "replay"


def find_nvcc(nvcc: str | os.PathLike[str] | None = None) -> Path:
    """nvcc from the argument, $NVCC, PATH, or /usr/local/cuda/bin; ReplayError when absent."""
    candidates = [nvcc, os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return Path(c)
    raise ReplayError("nvcc not found (looked at --nvcc, $NVCC, PATH, /usr/local/cuda/bin); install the CUDA toolkit")


def _nvcc_version(nvcc: Path) -> str:
    try:
        return subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise ReplayError(f"{nvcc} --version failed: {exc}") from exc


def build_flags(arch: str, checked: bool) -> list[str]:
    if not arch.startswith("sm_") or not arch[3:].rstrip("af").isdigit():
        raise ReplayError(f"arch must look like sm_90 or sm_90a, got {arch!r}")
    return ["-O2", "-lineinfo", "-std=c++17", f"-arch={arch}", f"-DQF_CHECKED={1 if checked else 0}"]


def build_kernel(
    arch: str = "sm_90",
    checked: bool = True,
    *,
    nvcc: str | os.PathLike[str] | None = None,
    cache: str | os.PathLike[str] | None = None,
    force: bool = False,
    timeout: float = 600,
) -> Path:
    """Compile the replay host program for `arch`; returns the cached executable's path."""
    nvcc_path = find_nvcc(nvcc)
    flags = build_flags(arch, checked)
    src = KERNEL_SOURCE.read_bytes()
    key = hashlib.sha256(src + _nvcc_version(nvcc_path).encode() + " ".join(flags).encode()).hexdigest()[:16]
    out_dir = Path(cache) if cache else cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    exe = out_dir / f"awq_replay-{arch}-{'checked' if checked else 'unchecked'}-{key}"
    if exe.is_file() and not force:
        return exe
    with replacing(exe) as tmp:
        cmd = [str(nvcc_path), *flags, "-o", str(tmp), str(KERNEL_SOURCE)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise ReplayError(f"nvcc timed out after {timeout}s building "
                              f"{KERNEL_SOURCE.name} for {arch}") from exc
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout)[-2000:]
            raise ReplayError(f"nvcc failed ({proc.returncode}) building "
                              f"{KERNEL_SOURCE.name} for {arch}:\n{tail}")
        os.chmod(tmp, 0o755)
    return exe


def detect_arch() -> str | None:
    """The first GPU's sm_XY from nvidia-smi, None when it cannot be asked."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    if not out or "." not in out[0]:
        return None
    major, minor = out[0].strip().split(".", 1)
    return f"sm_{major}{minor}" if (major + minor).isdigit() else None


def write_kernel_inputs(tensors: dict[str, np.ndarray], group_size: int, directory: str | os.PathLike[str]) -> Path:
    """Write header.txt + raw little-endian .bin files for the host program; returns the dir."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    x = tensors["x"]
    m, k = x.shape
    n = int(tensors["qweight"].shape[1]) * 8
    lines = [HEADER_MAGIC, f"M {m}", f"N {n}", f"K {k}", f"group_size {int(group_size)}",
             f"n_groups {int(tensors['scales'].shape[0])}"]
    for name, (fname, dtype) in _FILES.items():
        if name not in tensors:
            continue
        arr = np.ascontiguousarray(np.asarray(tensors[name]).astype(np.dtype(dtype).newbyteorder("<")))
        (d / fname).write_bytes(arr.tobytes())
        lines.append(f"tensor {name} {np.dtype(dtype).name} {arr.nbytes} {fname}")
    (d / "header.txt").write_text("\n".join(lines) + "\n")
    return d


def read_kernel_output(directory: str | os.PathLike[str], m: int, n: int) -> np.ndarray | None:
    """DIR/y.bin as float32 [M, N]; None when absent or of the wrong size."""
    p = Path(directory) / "y.bin"
    if not p.is_file() or p.stat().st_size != m * n * 4:
        return None
    return np.fromfile(p, dtype="<f4").reshape(m, n)


def run_project_kernel(bundle: Any, *, checked: bool, work_dir: Path, sanitizer: str | None = None,
                       arch: str | None = None, tool: str = "memcheck", timeout: float = 300,
                       padding: int | None = None) -> tuple[Any, np.ndarray | None]:
    """The project's CUDA kernel on a bundle under compute-sanitizer: the checked build is the
    reference kernel; the unchecked build is the PLANTED-BUG FIXTURE (it never judges a user's
    run). Returns (ReplayResult, output or None)."""
    from qforensics.replay.bundle import kernel_tensors
    from qforensics.replay.parse import attribute_buffers, parse_host_allocations
    from qforensics.replay.sanitizer import (
        find_sanitizer,
        run_sanitizer,
        sanitizer_command,
    )
    from qforensics.replay.verdict import inconclusive, judge_sanitizer

    label = "reference kernel (checked build)" if checked else "PLANTED-BUG FIXTURE (unchecked build)"
    san = find_sanitizer(sanitizer)
    if san is None:
        return inconclusive("sanitizer", "no sanitizer", f"{label}: compute-sanitizer not found"), None
    data, ref, _notes = kernel_tensors(bundle)
    group = int(bundle.meta.get("group_size") or -1)
    group = int(bundle.meta["K"]) if group == -1 else group
    if bundle.layout.name != "awq-gemm":
        group = 128 if int(bundle.meta["K"]) % 128 == 0 else int(bundle.meta["K"])
    exe = build_kernel(arch or detect_arch() or "sm_90", checked=checked)
    kin = write_kernel_inputs(data, group, Path(work_dir) / "kernel-in")
    argv = sanitizer_command(san, [str(exe), str(kin)], tool=tool, kernel_name="kns=qf_awq_gemm", padding=padding)
    run = run_sanitizer(argv, raw_path=Path(work_dir) / f"sanitizer-{tool}.txt", timeout=timeout)
    attribute_buffers(run.report, parse_host_allocations(run.report.host_lines))
    ran = any("qforensics-replay: kernel-done" in line for line in run.report.host_lines)
    res = judge_sanitizer(run.report, kernel_ran=ran, print_limit=100, path="sanitizer", timed_out=run.timed_out)
    res.summary = f"{label}: {res.summary}"
    res.details = {"sanitizer": run.to_dict()}
    y = read_kernel_output(kin, *data["x"].shape[:1], int(data["qweight"].shape[1]) * 8)
    if y is not None and ref is not None:
        with np.errstate(invalid="ignore"):
            err = np.abs(y.astype(np.float64) - ref)
        res.details["max_abs_err_vs_reference"] = float(np.nanmax(err)) if np.isfinite(err).any() else None
        res.details["nonfinite_outputs"] = int(np.count_nonzero(~np.isfinite(y)))
    return res, y
