"""The package's small CPython extensions (hooks/opcall.c), built and cached like
fused_reduce.c (hooks/fused.py: the system C compiler, once per source, flags and CPU, off the
caller's thread). They need Python's headers (``Python.h``) besides the compiler; without
them the callers go the slower way, and the trace's status says so.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import sysconfig
import threading
from pathlib import Path
from typing import Any

from qforensics.hooks import fused

def build_flags() -> tuple[str, ...]:
    """The compiler flags of the extension (hooks/prebuild.py builds it with them too)."""
    include = sysconfig.get_paths()["include"]
    # the interpreter's ABI is part of the cache key through its include path and tag
    return ("-O2", "-shared", "-fPIC", f"-I{include}",
            f"-DQF_ABI_{sys.implementation.cache_tag.replace('-', '_')}")


def _load_module(path: Path, name: str) -> Any:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    if spec is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


class Extension:
    """A small CPython extension of this package (a C source, a module name), built and cached
    like fused_reduce.c; `module()` is it once loaded, None until then (and for good when off:
    `off` says why)."""

    def __init__(self, source: Path, name: str, off: str | None = None,
                 thread_name: str = "qforensics-build-ext") -> None:
        self.source, self.name, self.off = source, name, off
        self._mod: Any = None
        self._thread: threading.Thread | None = None
        self._thread_name = thread_name
        self._tried_cache = False

    def build(self) -> Path:
        return fused.build(source=self.source, flags=build_flags(), libs=())

    def _loaded(self, mod: Any) -> None:
        """What a subclass takes from the module once loaded (before `module()` returns it)."""

    def _build_and_load(self) -> None:
        try:
            if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
                raise RuntimeError("Python.h not found (install the Python headers)")
            mod = _load_module(self.build(), self.name)
            self._loaded(mod)
            self._mod = mod  # set last: ready
        except Exception as exc:  # no compiler or headers, a failed build: Python's path
            self.off = f"{type(exc).__name__}: {str(exc)[:300]}"

    def module(self) -> Any:
        """The module, or None: not built yet (a background build starts), or off."""
        if self._mod is not None or self.off is not None:
            return self._mod
        if not self._tried_cache:
            self._tried_cache = True
            try:  # built by an earlier process (or at install): load it now (~1 ms)
                path = fused.library_path(source=self.source, flags=build_flags(), libs=())
                if path.exists() and fused.trusted(path):
                    self._build_and_load()
                    return self._mod
            except OSError:
                pass
        if self._thread is None:
            self._thread = threading.Thread(target=self._build_and_load, daemon=True,
                                            name=self._thread_name)
            self._thread.start()
        return None

    def wait(self, timeout: float = 120.0) -> None:
        """Block until the extension is built or has failed (tests, benchmarks; never hooks)."""
        self.module()
        t = self._thread
        if t is not None:
            t.join(timeout)
