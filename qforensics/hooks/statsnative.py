"""The stats op's C++ CPU kernel (hooks/statsop_cpu.cpp): an op call runs no Python.

Inside a compiled graph on the CPU the Python kernel (hooks/statscpu.py) costs ~100-200 us a
call between a layer's GEMMs, most of it the interpreter on cold caches, for ~60 us of C
work. This kernel does the same behind the dispatcher:
- built with the system C++ compiler (``$CXX``, else ``c++``) against this torch's headers,
  into the kernel cache (hooks/fused.py `build`: keyed by the source, fused_reduce.c, the
  flags, torch's version and the CPU; loaded only from a folder nobody else can write);
- hooks/prebuild.py builds it at install time; a process that finds it not built builds it
  when hooks/statscpu.py is first imported (~10 s, once per machine);
- no compiler, a failed build, ``QFORENSICS_STATS_KERNEL=python`` or
  ``QFORENSICS_REDUCE=eager``: the Python kernel is registered instead; `KERNEL` says which
  runs (the trace's status carries it, `stats_kernel`).
The record layout stays statsop.py's: its numbers reach the C++ source as -D flags.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch

from qforensics.hooks import fused, statsop

log = logging.getLogger("qforensics.hooks.capture")

SOURCE = Path(__file__).with_name("statsop_cpu.cpp")
KERNEL = {"kernel": "python", "why": "not loaded yet"}


def compiler() -> str:
    return os.environ.get("CXX") or "c++"


def _torch_dirs() -> tuple[str, str]:
    root = os.path.dirname(torch.__file__)
    return os.path.join(root, "include"), os.path.join(root, "lib")


def build_flags() -> tuple[str, ...]:
    """The compile flags: optimization, torch's headers and ABI, and the record layout of
    statsop.py (with fused_reduce.c's digest and torch's version, so that either one changed
    gives another library)."""
    inc, _ = _torch_dirs()
    layout = [f"-DQF_N_SCAL={statsop.N_SCAL}", f"-DQF_STAMP_MOD={statsop.STAMP_MOD}",
              f"-DQF_ENTRY_BITS={statsop._ENTRY_BITS}",
              f"-DQF_SNAP_HEADER={statsop.SNAP_HEADER}"]
    layout += [f"-DQF_SNAP_{name.upper()}={i}" for name, i in statsop.SNAP.items()]
    layout += [f"-DQF_COL_{name.upper()}={i}" for name, i in statsop.COL.items()]
    digest = hashlib.sha256(fused.SOURCE.read_bytes() + torch.__version__.encode())
    return ("-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC", "-std=c++17", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-DQF_DEPS={digest.hexdigest()[:16]}", "-I", inc, *layout)


def build_libs() -> tuple[str, ...]:
    _, lib = _torch_dirs()
    return ("-L", lib, "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}")


def build() -> Path:
    """Build the kernel's library (or find it built); its path."""
    return fused.build(compiler(), source=SOURCE, flags=build_flags(), libs=build_libs())


def load() -> bool:
    """Build if needed and register the C++ kernel for the op's CPU dispatch key; False (and
    why, in KERNEL) when it is not to be used or could not be."""
    if os.environ.get("QFORENSICS_STATS_KERNEL", "auto").lower() == "python":
        KERNEL.update(kernel="python", why="QFORENSICS_STATS_KERNEL=python")
        return False
    if fused.REDUCER.off == "QFORENSICS_REDUCE=eager":
        KERNEL.update(kernel="python", why="QFORENSICS_REDUCE=eager")
        return False
    try:
        path = build()
        torch.ops.load_library(str(path))
    except Exception as exc:  # noqa: BLE001 - no compiler, no headers: the Python kernel runs
        why = f"{type(exc).__name__}: {str(exc)[:300]}"
        KERNEL.update(kernel="python", why=why)
        log.warning("qforensics: the stats op's C++ kernel is not used (%s); its Python "
                    "kernel runs instead", why)
        return False
    KERNEL.update(kernel="c++", why="")
    return True
