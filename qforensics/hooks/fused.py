"""The end-of-step reduction of CPU activations in one pass (a small C kernel, fused_reduce.c).

On CPU the eager reduction in reduce.fast_parts reads a step's activations about seven times:
a float32 copy, sum, sum of squares (plus its product), per-channel min and max, per-token min
and max. fused_reduce.c reads each bf16 or fp32 value once and writes the same float32 vector,
several times faster at vLLM's decode shapes (bench/hook_cost.py --vllm). Same numbers up to
summation order; NaN and Inf propagate as in torch (tests/hooks/test_fused_reduce.py checks
both against numpy). The same library computes reduce.fast_logits' figures of the last logits
row (min, max, mean, variance, softmax entropy, top 5) in one call instead of about ten torch
ops (0.1 ms instead of 0.6 ms per vLLM decode step on [8, 49152] bf16 logits), the per-row
non-finite flags of reduce.nonfinite_rows (a bit test), and a step plan's reduction in the split
layout of hooks/planunpack.py (`split`: sums, channel ranges and row maxima into separate
regions of one vector, from the same core as the packed layout).

How it is built, and why not torch.compile: Inductor would fuse the same expression, but
compiling in a background thread sets torch's process-wide ``is_compiling()`` flag for seconds,
and while it is set PyTorch skips ``always_call`` forward hooks when a forward raises: the guard's
and capture's step bookkeeping (and any user's) would break. The C file needs no torch headers:

- the first CPU reduction of a process loads the library when it is already built; else it
  starts a background thread that runs the system C compiler (``$CC``, else ``cc``) once, into
  ``kernels/`` under the cache root (qforensics/cachedir.py), keyed by the source, the flags and
  the CPU; later processes load the cached library;
- until it is loaded, and for fp16, float64, non-contiguous or GPU tensors, the eager pass runs;
- no compiler, a failed build, or ``QFORENSICS_REDUCE=eager``: the eager pass, always; the
  trace's status says which ran (``reduction``, ``fused_reductions``, ``eager_reductions``).

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
_SYMBOLS = {torch.bfloat16: "qf_reduce_bf16", torch.float32: "qf_reduce_f32"}
_LOGITS = {torch.bfloat16: "qf_logits_bf16", torch.float32: "qf_logits_f32"}
_NONFINITE = {torch.bfloat16: "qf_nonfinite_bf16", torch.float32: "qf_nonfinite_f32"}
_SPLIT = {torch.bfloat16: "qf_split_bf16", torch.float32: "qf_split_f32"}
_TAKE = {torch.bfloat16: "qf_take_bf16", torch.float32: "qf_take_f32"}


def packed_len(g: int, rows: int, chans: int, keep: bool) -> int:
    """Length of reduce.fast_parts' vector for g tensors of rows x chans."""
    if rows == 1:
        return 4 * g + (g * chans if keep else 0)
    return 2 * g + (2 * g * chans if keep else 2 * g) + g * rows


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
        self._fns: dict[torch.dtype, Any] | None = None
        self._logit_fns: dict[torch.dtype, Any] = {}
        self._nonfinite_fns: dict[torch.dtype, Any] = {}
        self._split_fns: dict[torch.dtype, Any] = {}
        self._take_fns: dict[torch.dtype, Any] = {}
        self._group_fn: Any = None
        self._spans_fn: Any = None
        self._thread: threading.Thread | None = None
        self._tried_cache = False
        self.calls = 0
        self.fused_calls = 0
        self.eager_why: dict[str, int] = {}  # why a call took the eager pass, for the status

    def parts(self, x: torch.Tensor, rows: int, chans: int, keep: bool,
              out: torch.Tensor | None = None) -> list[torch.Tensor] | None:
        """reduce.fast_parts' vector for g stacked tensors, in one pass; None: use eager.
        `out`: a contiguous float32 CPU vector of packed_len values to write it into."""
        if self.off is not None or x.device.type != "cpu":
            return None
        self.calls += 1
        fns = self._fns if self.ready() else None
        if fns is None:
            return None if self.off is not None else self._eager("not built yet")
        fn = fns.get(x.dtype)
        if fn is None:
            return self._eager(f"dtype {str(x.dtype).replace('torch.', '')}")
        g = int(x.shape[0]) if x.dim() else 0
        if g == 0 or rows <= 0 or chans <= 0 or x.numel() != g * rows * chans:
            return self._eager("shape")
        if not x.is_contiguous():
            return self._eager("layout")
        n = packed_len(g, rows, chans, keep)
        if out is None:
            out = torch.empty(n, dtype=torch.float32)
        elif (out.numel() != n or out.dtype != torch.float32 or out.device.type != "cpu"
              or not out.is_contiguous()):
            return self._eager("out")
        if fn(x.data_ptr(), g, rows, chans, int(keep), out.data_ptr()) != 0:
            return self._eager("out of memory")
        self.fused_calls += 1
        return [out]

    def ready(self) -> bool:
        """The library is loaded. Its first call in a process loads it when it is already
        built (~1 ms: hooks/prebuild.py builds it at install time), so that a process's numbers
        do not depend on when a background thread finished; else a background thread builds it
        (False until then, and for good when off)."""
        if self._fns is not None:
            return True
        if self.off is not None:
            return False
        if not self._tried_cache:
            self._tried_cache = True
            try:
                if library_path().exists() and trusted(library_path()):
                    self._load()
                    if self._fns is not None:
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

    def _eager(self, why: str) -> None:
        self.eager_why[why] = self.eager_why.get(why, 0) + 1
        return None

    def split_ready(self, dtype: torch.dtype) -> bool:
        """The split-layout kernel for this dtype is loaded (hooks/planunpack.SplitLayout)."""
        return self._fns is not None and dtype in self._split_fns

    def split(self, x: torch.Tensor, rows: int, chans: int, sums: int, cmin: int | None,
              cmax: int | None, tok: int) -> bool:
        """g stacked tensors reduced into a plan's split layout, at the given addresses:
        sums [S, Q, min, max] (4g floats), channel ranges (or values) g*C each (None: not
        kept), per-row absmax g*rows. False (nothing written): use the packed path."""
        fn = self._split_fns.get(x.dtype) if self._fns is not None else None
        g = int(x.shape[0]) if x.dim() else 0
        if (fn is None or x.device.type != "cpu" or not x.is_contiguous() or g == 0
                or x.numel() != g * rows * chans):
            return False
        self.calls += 1
        self.fused_calls += 1
        fn(x.data_ptr(), g, rows, chans, sums, cmin, cmax, tok)
        return True

    def take_address(self, dtype: torch.dtype) -> int:
        """The address of the one-tensor kernel (fused_reduce.c `qf_take_*`) for this dtype,
        for hooks/fast_take.c to call where a hook takes the tensor; 0: none."""
        fn = self._take_fns.get(dtype) if self._fns is not None else None
        return int(ctypes.cast(fn, ctypes.c_void_p).value or 0) if fn is not None else 0

    def take(self, x: torch.Tensor, rows: int, chans: int, ptrs: tuple) -> bool:
        """One tensor reduced into a split layout at `ptrs` (S, Q, min, max, channel minima or
        values, channel maxima, row maxima; None: not written), as a hook-time take does it.
        False (nothing written): not for this tensor."""
        fn = self._take_fns.get(x.dtype) if self.ready() else None
        if (fn is None or x.device.type != "cpu" or not x.is_contiguous()
                or x.numel() != rows * chans):
            return False
        fn(x.data_ptr(), rows, chans, *ptrs)
        return True

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
            self._split_fns = bind(_SPLIT, ptr, i64, i64, i64, ptr, ptr, ptr, ptr)
            self._take_fns = bind(_TAKE, ptr, i64, i64, *[ptr] * 7)
            self._group_fn = lib.qf_group
            self._group_fn.restype = ctypes.c_int
            self._group_fn.argtypes = [i64, ptr, ptr, ptr, ptr, i64, ctypes.c_float, ptr, i64,
                                      ptr]
            self._spans_fn = lib.qf_spans
            self._spans_fn.restype = i64
            self._spans_fn.argtypes = [i64, ptr, ptr]
            self._fns = bind(_SYMBOLS, ptr, i64, i64, i64, ctypes.c_int, ptr)  # set last: ready
        except Exception as exc:  # no compiler, a failed build: the eager pass from now on
            self.off = f"{type(exc).__name__}: {str(exc)[:300]}"

    def wait(self, timeout: float = 120.0) -> None:
        """Block until the library is built or has failed (tests, benchmarks; never hooks)."""
        t = self._thread
        if t is not None:
            t.join(timeout)

    def status(self) -> dict[str, Any]:
        """For the trace's status: how the step reductions ran in this process."""
        return {"reduction": "eager" if self.off or self._fns is None else "fused",
                **({"reduction_off": self.off} if self.off else {}),
                "fused_reductions": self.fused_calls,
                "eager_reductions": self.calls - self.fused_calls,
                "eager_why": dict(self.eager_why)}


REDUCER = FusedReducer(enabled=os.environ.get("QFORENSICS_REDUCE", "auto").lower() != "eager")
