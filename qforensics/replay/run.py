"""Replay orchestration: bundle -> the kernel the run used on the recorded data (numeric leg) and,
with a GPU, the same kernel under compute-sanitizer (sanitizer leg) -> verdicts.

The kernel under judgement is the run's own, named by the trace (`meta["kernel"]`), or one the
user picks (`kernel=` a torch kernel of qforensics.replay.torch_kernels, or `launcher=` their own
`module:function`). The project's CUDA kernel is never the suspect: it is the checked reference
and, in its unchecked build, a planted-bug fixture for testing the sanitizer path (gpu_check).
No temporary file outlives a call unless the caller asked for a work_dir or bundle_out.
"""

from __future__ import annotations

import glob
import json
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

from qforensics.trace import validate
from qforensics.errors import ReplayError
from qforensics.replay.bounds import BoundModel
from qforensics.replay.build import build_bundle_from_trace
from qforensics.replay.bundle import Bundle, is_bundle, read_bundle, write_bundle
from qforensics.replay.judge import judge_numeric
from qforensics.replay.launcher import DONE_MARKER
from qforensics.replay.parse import attribute_buffers, parse_host_allocations
from qforensics.replay.sanitizer import (
    DEFAULT_PRINT_LIMIT,
    find_sanitizer,
    run_sanitizer,
    sanitizer_command,
)
from qforensics.replay.torch_kernels import KERNELS
from qforensics.replay.verdict import (
    ReplayResult,
    Verdict,
    inconclusive,
    judge_sanitizer,
    result_document,
)

# torch kernels that have a CUDA --launcher entry point for the sanitizer leg
CUDA_LAUNCHERS = {"torch-int4pack": "qforensics.replay.torch_kernels:cuda_int4pack_mm",
                  "torch-scaled-mm": "qforensics.replay.torch_kernels:cuda_scaled_mm",
                  "torch-compile": "qforensics.replay.torch_kernels:cuda_compiled_dequant_mm"}


def detect_gpu() -> tuple[bool, str]:
    """(available, how): /dev/nvidia[0-9]* or `nvidia-smi -L` (never imports torch)."""
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
    return False, "no /dev/nvidia*, and nvidia-smi is absent or lists no GPU"


@dataclass
class ReplayOutcome:
    bundle: Bundle
    results: list[ReplayResult] = field(default_factory=list)
    kernel_output: np.ndarray | None = None

    def exit_code(self) -> int:
        """1: a KERNEL FAULT / KERNEL DIVERGES / DATA finding, or nothing measured at all (only
        INCONCLUSIVE); 0: measured and NOT REPRODUCED."""
        if any(r.failing for r in self.results):
            return 1
        if not any(r.verdict is Verdict.NOT_REPRODUCED for r in self.results):
            return 1
        return 0

    def document(self) -> dict[str, Any]:
        return result_document(self.results, bundle_path=str(self.bundle.path) if self.bundle.path else None,
                               meta=self.bundle.meta)


def load_bundle(source: str | os.PathLike[str], *, call: int | None = None, bundle_out: str | os.PathLike[str] | None = None,
                open_trace: Callable[[Any], Any] | None = None) -> Bundle:
    """A bundle file is read (and validated); a trace is turned into a bundle (written to bundle_out
    when given, else kept in memory)."""
    src = Path(source)
    validate.check_regular_file(src, "trace or replay bundle", ReplayError)
    if is_bundle(src):
        if call is not None:
            raise ReplayError(f"{src} is already a replay bundle (one call); --call applies to traces only")
        return read_bundle(src)
    return build_bundle_from_trace(src, bundle_out, call, open_trace=open_trace)


def launcher_bound(spec: str, out_dir: Path) -> tuple[BoundModel | None, str]:
    """The bound a launcher stated (its function's `error_bound`, written by the child as
    bound.json); (None, why) when it stated none or an unusable one."""
    p = out_dir / "bound.json"
    if not p.is_file():
        return None, (f"{spec} states no error bound (give its function an `error_bound` attribute: "
                      "\"float32\" or a dict, docs/replay.md)")
    try:
        return BoundModel.from_spec(json.loads(p.read_text()), kernel=spec, device="launcher"), ""
    except (ValueError, TypeError) as exc:
        return None, f"{spec} states an unusable error bound: {exc}"


def _run_launcher(bundle_path: Path, spec: str, out_dir: Path, m: int, n: int, timeout: float) -> tuple[np.ndarray | None, str]:
    """The user's launcher in a child process (a crash there is a finding, not ours)."""
    argv = [sys.executable, "-m", "qforensics.replay.launcher", "--bundle", str(bundle_path), "--launcher", spec,
            "--out", str(out_dir)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"the launcher did not finish within {timeout:g} s"
    y = out_dir / "y.bin"
    if proc.returncode != 0 or DONE_MARKER not in proc.stdout:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return None, f"the launcher exited with {proc.returncode}: {tail[0][:300]}"
    if not y.is_file() or y.stat().st_size != m * n * 4:
        return None, f"the launcher returned no [M={m}, N={n}] output"
    return np.fromfile(y, dtype="<f4").reshape(m, n).astype(np.float64), "ok"


def numeric_leg(bundle: Bundle, *, kernel: str | None, launcher: str | None, work_dir: Path,
                timeout: float = 600) -> tuple[ReplayResult, np.ndarray | None]:
    """Run the chosen kernel on the recorded tile and judge it against the float64 reference."""
    layout = bundle.layout
    if launcher:
        path = bundle.path or write_bundle(bundle, work_dir / "bundle.h5")
        y, why = _run_launcher(Path(path), launcher, work_dir / "launcher-out", bundle.meta["M"], bundle.meta["N"], timeout)
        if y is None:
            return inconclusive("launcher", "launcher failed", f"{launcher}: {why}"), None
        model, why = launcher_bound(launcher, work_dir / "launcher-out")
        return judge_numeric(bundle, y, launcher, path="launcher", bound=model, no_bound_reason=why), y
    name = kernel or bundle.meta.get("kernel")
    fits = [k for k, kern in KERNELS.items() if kern.can_run(bundle.tensors, bundle.meta, layout)[0]]
    if name is None or name not in KERNELS:
        used = f"the run used {name!r}, which" if name else "the trace does not say which kernel the run used, so it"
        hint = f"--kernel {' | '.join(fits)}" if fits else "no torch kernel here takes this layout"
        return inconclusive("kernel", "kernel not callable",
                            f"{used} cannot be called here; judge a kernel on this data with {hint}, or "
                            "--launcher MODULE:FUNCTION"), None
    ok, why = KERNELS[name].can_run(bundle.tensors, bundle.meta, layout)
    if not ok:
        return inconclusive("kernel", "kernel cannot take this tile", f"{name}: {why}"), None
    try:
        y = KERNELS[name].run(bundle.tensors, bundle.meta, layout)
    except Exception as exc:  # the op refusing or failing on the recorded data is reported, not ours to crash on
        return inconclusive("kernel", "kernel raised", f"{name} raised on the recorded tile: {exc!r}"[:800]), None
    res = judge_numeric(bundle, y, name)
    if bundle.meta.get("fixture"):
        res.summary = f"[fixture: the project's own fake-quant layer, not a user kernel] {res.summary}"
    return res, y


def sanitizer_leg(bundle: Bundle, *, kernel: str | None, launcher: str | None, work_dir: Path, tool: str,
                  sanitizer: str | None, kernel_name: str | None, print_limit: int, timeout: float) -> ReplayResult:
    """The kernel's CUDA launch under compute-sanitizer (a child process); needs a GPU."""
    name = kernel or bundle.meta.get("kernel")
    spec = launcher or CUDA_LAUNCHERS.get(str(name))
    if spec is None:
        return inconclusive("sanitizer", "no CUDA launch", f"{name!r} has no CUDA launch qforensics can run under "
                            "compute-sanitizer; pass --launcher MODULE:FUNCTION")
    san = find_sanitizer(sanitizer)
    if san is None:
        return inconclusive("sanitizer", "no sanitizer", "compute-sanitizer not found (pass --sanitizer PATH, put it "
                            "on PATH, or pip install nvidia-cuda-sanitizer-api)")
    path = bundle.path or write_bundle(bundle, work_dir / "bundle.h5")
    target = [sys.executable, "-m", "qforensics.replay.launcher", "--bundle", str(path), "--launcher", spec,
              "--out", str(work_dir / "sanitizer-out")]
    argv = sanitizer_command(san, target, tool=tool, kernel_name=kernel_name, print_limit=print_limit)
    run = run_sanitizer(argv, raw_path=work_dir / f"sanitizer-{tool}.txt", timeout=timeout)
    attribute_buffers(run.report, parse_host_allocations(run.report.host_lines))
    ran = any(DONE_MARKER in line for line in run.report.host_lines)
    res = judge_sanitizer(run.report, kernel_ran=ran, print_limit=print_limit, path="sanitizer", timed_out=run.timed_out)
    res.summary = f"{spec} under compute-sanitizer {tool}: {res.summary}"
    res.details = {"sanitizer": run.to_dict()}
    return res


def replay(source: str | os.PathLike[str], *, call: int | None = None, bundle_out: str | os.PathLike[str] | None = None,
           kernel: str | None = None, launcher: str | None = None, sanitize: str = "auto", tool: str = "memcheck",
           sanitizer: str | None = None, kernel_name: str | None = None, print_limit: int = DEFAULT_PRINT_LIMIT,
           work_dir: str | os.PathLike[str] | None = None, timeout: float = 600,
           open_trace: Callable[[Any], Any] | None = None,
           gpu_probe: Callable[[], tuple[bool, str]] = detect_gpu) -> ReplayOutcome:
    """sanitize: "auto" (sanitizer leg when a GPU is present, else an INCONCLUSIVE line saying so),
    "on" (required: INCONCLUSIVE without a GPU), "off" (numeric leg only)."""
    if sanitize not in ("auto", "on", "off"):
        raise ReplayError(f"sanitize must be auto, on or off, got {sanitize!r}")
    if kernel is not None and kernel not in KERNELS:
        raise ReplayError(f"unknown kernel {kernel!r}; known: {', '.join(KERNELS)}")
    bundle = load_bundle(source, call=call, bundle_out=bundle_out, open_trace=open_trace)
    with tempfile.TemporaryDirectory(prefix="qf-replay-") as tmp:
        wd = Path(work_dir) if work_dir else Path(tmp)
        wd.mkdir(parents=True, exist_ok=True)
        res, y = numeric_leg(bundle, kernel=kernel, launcher=launcher, work_dir=wd, timeout=timeout)
        outcome = ReplayOutcome(bundle, [res], y)
        if sanitize != "off":
            has_gpu, how = gpu_probe()
            if has_gpu:
                outcome.results.append(sanitizer_leg(bundle, kernel=kernel, launcher=launcher, work_dir=wd, tool=tool,
                                                     sanitizer=sanitizer, kernel_name=kernel_name,
                                                     print_limit=print_limit, timeout=timeout))
            else:
                outcome.results.append(inconclusive(
                    "sanitizer", "no GPU", f"sanitizer leg not run: no GPU ({how}); compute-sanitizer cannot "
                    "instrument anything without one, so memory safety was not measured"))
        if not work_dir and bundle.path is not None and Path(tmp) in Path(bundle.path).parents:
            bundle.path = None  # it lived in the temp dir, which is gone now
    return outcome
