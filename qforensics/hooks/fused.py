"""The CPU's one-pass kernels in a small C library (fused_reduce.c): the stats op's reduction of
one call's tensors into a ring row (`group`: hooks/statscpu.py, hooks/statsop_cpu.cpp and
hooks/opcall.c call it), the copy of a step's kept channel spans (`spans`: hooks/graphread.py),
reduce.fast_logits' figures of the last logits row (min, max, mean, variance, softmax entropy,
top 5: one call instead of about ten torch ops, 0.1 ms instead of 0.6 ms per vLLM decode step on
[8, 49152] bf16 logits) and the per-row non-finite flags of reduce.nonfinite_rows (a bit test).
Same numbers as numpy up to summation order; NaN and Inf propagate as in torch
(tests/hooks/test_statsop.py and tests/hooks/test_fused_reduce.py check them against numpy).

How it is built, and why not torch.compile: Inductor would fuse the same expression, but
compiling in a background thread sets torch's process-wide ``is_compiling()`` flag for seconds,
and while it is set PyTorch skips ``always_call`` forward hooks when a forward raises: the guard's
and capture's step bookkeeping (and any user's) would break. The C file needs no torch headers:

- the first CPU reduction of a process loads the library when it is already built; else it
  starts a background thread that runs the system C compiler (``$CC``, else ``cc``) once, into
  ``kernels/`` under the cache root (qforensics/cachedir.py), keyed by the source, the flags and
  the CPU; later processes load the cached library;
- until it is loaded the callers take their torch or numpy path;
- no compiler, a failed build, or ``QFORENSICS_REDUCE=eager``: those paths, always; the
  trace's status says which ran (``reduction``).

The call goes through ctypes, which releases the GIL while the kernel runs.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from qforensics.atomic import replacing
from qforensics.cachedir import cache_root

log = logging.getLogger("qforensics.hooks.capture")

SOURCE = Path(__file__).with_name("fused_reduce.c")
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC")
LIBS = ("-lm",)
_LOGITS = {torch.bfloat16: "qf_logits_bf16", torch.float32: "qf_logits_f32"}
_NONFINITE = {torch.bfloat16: "qf_nonfinite_bf16", torch.float32: "qf_nonfinite_f32"}


def cache_dir() -> Path:
    return cache_root() / "kernels"


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def library_path(cc: str | None = None, out_dir: Path | None = None, *,
                 source: Path = SOURCE, flags: tuple[str, ...] = FLAGS,
                 libs: tuple[str, ...] = LIBS) -> Path:
    """Where the library for this source, compiler, flags and CPU is (or will be) kept."""
    cc = cc or os.environ.get("CC") or "cc"
    key = hashlib.sha256(source.read_bytes() + " ".join((cc,) + flags + libs).encode()
                         + _cpu_id().encode())
    return (out_dir or cache_dir()) / f"{source.stem}-{key.hexdigest()[:16]}.so"


def trusted(path: Path) -> bool:
    """Only this user (or root) can have written `path`: it and every folder above it are
    owned by this user or root and writable by nobody else (a root-owned sticky folder such as
    /tmp counts: nobody else can replace what this user made in it). A library is loaded into
    the process only from such a path."""
    me = os.geteuid()
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if st.st_uid not in (me, 0) or st.st_mode & 0o022 or stat.S_ISLNK(st.st_mode):
        return False
    for parent in Path(os.path.abspath(path)).parents:
        try:
            ps = os.stat(parent)
        except OSError:
            return False
        if ps.st_uid not in (me, 0):
            return False
        if ps.st_mode & 0o022 and not (ps.st_uid == 0 and ps.st_mode & stat.S_ISVTX):
            return False
    return True


_PRIVATE: list[Path] = []  # this process's own kernel folder, when the cache is not trusted


def _private_dir() -> Path:
    if not _PRIVATE:
        _PRIVATE.append(Path(tempfile.mkdtemp(prefix="qforensics-kernels-")))  # mode 0700
    return _PRIVATE[0]


def build(cc: str | None = None, out_dir: Path | None = None, *, source: Path = SOURCE,
          flags: tuple[str, ...] = FLAGS, libs: tuple[str, ...] = LIBS) -> Path:
    """Compile a C source of this package (fused_reduce.c unless told) into a shared library,
    or find it already built; its path. A cache folder or file that others could write is
    never loaded from: the library is then built into a private folder of this process."""
    cc = cc or os.environ.get("CC") or "cc"
    dst = library_path(cc, out_dir, source=source, flags=flags, libs=libs)
    if dst.exists() and trusted(dst):
        return dst
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler ({cc!r} not found)")
    dst_dir = dst.parent
    try:
        dst_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:
        pass
    if not trusted(dst_dir) or (dst.exists() and not trusted(dst)):
        log.warning("qforensics: kernel cache %s can be written by others; building into a "
                    "private folder instead", dst_dir)
        dst = _private_dir() / dst.name
        dst_dir = dst.parent
        if dst.exists():
            return dst
    with replacing(dst, suffix=".so") as tmp:  # atomic: another process may build the same file
        r = subprocess.run([cc, *flags, "-o", str(tmp), str(source), *libs],
                           capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed: {(r.stderr or r.stdout).strip()[-300:]}")
    return dst


class FusedReducer:
    """One-pass CPU reductions through fused_reduce.c, built off the hook's thread."""

    def __init__(self, enabled: bool = True) -> None:
        self.off: str | None = None if enabled else "QFORENSICS_REDUCE=eager"
        self._logit_fns: dict[torch.dtype, Any] = {}
        self._nonfinite_fns: dict[torch.dtype, Any] = {}
        self._group_fn: Any = None
        self._spans_fn: Any = None
        self._thread: threading.Thread | None = None
        self._tried_cache = False

    def ready(self) -> bool:
        """The library is loaded. Its first call in a process loads it when it is already
        built (~1 ms: hooks/prebuild.py builds it at install time), so that a process's numbers
        do not depend on when a background thread finished; else a background thread builds it
        (False until then, and for good when off)."""
        if self._group_fn is not None:
            return True
        if self.off is not None:
            return False
        if not self._tried_cache:
            self._tried_cache = True
            try:
                if library_path().exists() and trusted(library_path()):
                    self._load()
                    if self._group_fn is not None:
                        return True
            except OSError:
                pass
        if self.off is None and (self._thread is None or not self._thread.is_alive()):
            self._thread = threading.Thread(target=self._load, daemon=True,
                                            name="qforensics-build")
            self._thread.start()
        return False

    def logits(self, v: torch.Tensor) -> torch.Tensor | None:
        """reduce.fast_logits' 15 figures of one row of logits in one C call; None: use the
        torch ops (not built yet, GPU, another dtype, a strided row)."""
        fn = self._logit_fns.get(v.dtype) if self.ready() else None
        if fn is None or v.device.type != "cpu" or v.dim() != 1 or not v.is_contiguous():
            return None
        out = torch.empty(15, dtype=torch.float32)
        fn(v.data_ptr(), v.numel(), out.data_ptr())
        return out

    def group(self) -> Any:
        """fused_reduce.c's `qf_group` (one stats-op call's tensors into a ring row, as
        hooks/statscpu.py `stats_cpu` describes them), or None: not loaded."""
        return self._group_fn if self.ready() else None

    def spans(self) -> Any:
        """fused_reduce.c's `qf_spans` (spans of floats copied side by side, given as
        (address, count) pairs; hooks/graphread.py), or None: not loaded."""
        return self._spans_fn if self.ready() else None

    def nonfinite_rows(self, t: torch.Tensor) -> torch.Tensor | None:
        """reduce.nonfinite_rows' [rows, 1] flags in one C pass; None: use the torch ops (not
        built yet, GPU, another dtype, strided, no rows)."""
        fn = self._nonfinite_fns.get(t.dtype) if self.ready() else None
        if (fn is None or t.device.type != "cpu" or not t.dim() or not t.shape[-1]
                or not t.is_contiguous()):
            return None
        chans = int(t.shape[-1])
        rows = t.numel() // chans
        out = torch.empty((rows, 1), dtype=torch.float32)
        fn(t.data_ptr(), rows, chans, out.data_ptr())
        return out

    def _load(self) -> None:
        try:
            lib = ctypes.CDLL(str(build()))

            def bind(symbols: dict[torch.dtype, str], *argtypes: Any) -> dict[torch.dtype, Any]:
                fns = {}
                for dtype, name in symbols.items():
                    fn = getattr(lib, name)
                    fn.restype = ctypes.c_int
                    fn.argtypes = list(argtypes)
                    fns[dtype] = fn
                return fns

            i64, ptr = ctypes.c_int64, ctypes.c_void_p
            self._logit_fns = bind(_LOGITS, ptr, i64, ptr)
            self._nonfinite_fns = bind(_NONFINITE, ptr, i64, i64, ptr)
            self._spans_fn = lib.qf_spans
            self._spans_fn.restype = i64
            self._spans_fn.argtypes = [i64, ptr, ptr]
            group = lib.qf_group
            group.restype = ctypes.c_int
            group.argtypes = [i64, ptr, ptr, ptr, ptr, i64, ctypes.c_float, ptr, i64, ptr]
            self._group_fn = group  # set last: ready
        except Exception as exc:  # no compiler, a failed build: the eager pass from now on
            self.off = f"{type(exc).__name__}: {str(exc)[:300]}"

    def wait(self, timeout: float = 120.0) -> None:
        """Block until the library is built or has failed (tests, benchmarks; never hooks)."""
        t = self._thread
        if t is not None:
            t.join(timeout)

    def status(self) -> dict[str, Any]:
        """For the trace's status: whether the C kernels ran in this process."""
        return {"reduction": "eager" if self.off or self._group_fn is None else "fused",
                **({"reduction_off": self.off} if self.off else {})}


REDUCER = FusedReducer(enabled=os.environ.get("QFORENSICS_REDUCE", "auto").lower() != "eager")
