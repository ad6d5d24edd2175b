"""Find compute-sanitizer, build its command line, run a target under it, keep the raw output."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from qforensics.errors import ReplayError
from qforensics.replay.parse import parse_sanitizer_output
from qforensics.replay.records import SanitizerReport

TOOLS = ("memcheck", "initcheck", "racecheck", "synccheck")
DEFAULT_ERROR_EXITCODE = 86
DEFAULT_PRINT_LIMIT = 100
WHEEL = "nvidia-cuda-sanitizer-api"


def _wheel_sanitizer() -> Path | None:
    try:
        dist = metadata.distribution(WHEEL)
    except metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name == "compute-sanitizer" and "x86" not in f.parts[:-1]:
            p = Path(str(dist.locate_file(f)))
            if p.is_file():
                return p
    return None


def find_sanitizer(explicit: str | os.PathLike[str] | None = None) -> Path | None:
    """--sanitizer PATH, else compute-sanitizer on PATH, else the nvidia-cuda-sanitizer-api wheel's.

    An explicit path that is not an executable file is a ReplayError; otherwise None when absent.
    """
    if explicit:
        p = Path(explicit)
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise ReplayError(f"--sanitizer {explicit}: not an executable file")
        return p
    found = shutil.which("compute-sanitizer")
    if found:
        return Path(found)
    for c in ("/usr/local/cuda/compute-sanitizer/compute-sanitizer", "/usr/local/cuda/bin/compute-sanitizer"):
        if os.access(c, os.X_OK):
            return Path(c)
    return _wheel_sanitizer()


def sanitizer_command(
    sanitizer: str | os.PathLike[str],
    target: list[str],
    *,
    tool: str = "memcheck",
    kernel_name: str | None = None,
    error_exitcode: int = DEFAULT_ERROR_EXITCODE,
    print_limit: int = DEFAULT_PRINT_LIMIT,
    padding: int | None = None,
) -> list[str]:
    """The exact argv: sanitizer --tool T [--kernel-name kns=NAME] --error-exitcode E --print-limit P
    [--padding B (memcheck)] -- target..."""
    if tool not in TOOLS:
        raise ReplayError(f"unknown sanitizer tool {tool!r}; choose one of {', '.join(TOOLS)}")
    cmd = [str(sanitizer), "--tool", tool]
    if kernel_name:
        cmd += ["--kernel-name", kernel_name if "=" in kernel_name else f"kns={kernel_name}"]
    cmd += ["--error-exitcode", str(int(error_exitcode)), "--print-limit", str(int(print_limit))]
    if padding and tool == "memcheck":
        cmd += ["--padding", str(int(padding))]
    return cmd + list(target)


def sanitizer_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for the target: the caller's plus PYTORCH_NO_CUDA_MEMORY_CACHING=1 (so the
    caching allocator cannot hide an overrun inside a larger block)."""
    env = dict(os.environ if base is None else base)
    env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    return env


@dataclass
class SanitizerRun:
    argv: list[str]
    returncode: int | None
    output: str
    raw_path: Path | None
    report: SanitizerReport
    timed_out: bool = False

    def to_dict(self) -> dict[str, object]:
        return {"argv": self.argv, "returncode": self.returncode, "raw_output": str(self.raw_path) if self.raw_path else None,
                "timed_out": self.timed_out, "report": self.report.to_dict()}


def run_sanitizer(
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    raw_path: str | os.PathLike[str] | None = None,
    timeout: float = 600,
    cwd: str | os.PathLike[str] | None = None,
) -> SanitizerRun:
    """Run argv (from sanitizer_command), stdout and stderr merged, save it to raw_path, parse it."""
    timed_out = False
    try:
        proc = subprocess.run(argv, env=sanitizer_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=timeout, cwd=cwd)
        out, rc = proc.stdout.decode("utf-8", "replace"), proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode("utf-8", "replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        rc, timed_out = None, True
    except OSError as exc:
        raise ReplayError(f"cannot run {argv[0]}: {exc}") from exc
    path = None
    if raw_path is not None:
        path = Path(raw_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(out)
    return SanitizerRun(argv=list(argv), returncode=rc, output=out, raw_path=path,
                        report=parse_sanitizer_output(out), timed_out=timed_out)
