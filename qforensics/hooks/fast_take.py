"""A step plan's takes in C: fast_take.c, a small CPython extension, built and cached like
fused_reduce.c (hooks/fused.py: the system C compiler, once per source, flags and CPU, off the
hook's thread).

Why: a decode step's ~300 takes each checked the plan in Python and copied through
`ctypes.memmove`, ~4 us a take, most of it interpreter and ctypes overhead; the extension does
the same checks through the tensor's Python attributes and a memcpy. Only the takes that match
their plan and need nothing more than a copy (or the check that an earlier take copied the
same tensor) run in C; every other take goes to PendingStep's Python path unchanged.

Needs Python's headers (``Python.h``) besides the compiler; without them, with
``QFORENSICS_REDUCE=eager``, or until the build is done, every take runs in Python, which the
trace's status says (``takes``).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import sysconfig
import threading
from pathlib import Path
from typing import Any

from qforensics.hooks import fused

SOURCE = Path(__file__).with_name("fast_take.c")
MODULE = "qf_fast_take"


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


class FastTake(Extension):
    """fast_take.c: its Cursor type once built; None until then (and for good when off)."""

    def __init__(self, enabled: bool = True) -> None:
        super().__init__(SOURCE, MODULE, None if enabled else "QFORENSICS_REDUCE=eager",
                         "qforensics-build-take")
        self._cursor: type | None = None
        self.hook_type: type | None = None  # the extension's Hook, once loaded
        self.forward_type: type | None = None  # its Forward (a module's forward + the hook)

    def _loaded(self, mod: Any) -> None:
        self.hook_type = mod.Hook
        self.forward_type = mod.Forward
        self._cursor = mod.Cursor

    def cursor_type(self) -> type | None:
        """The Cursor type, or None: not built yet (a background build starts), or off."""
        self.module()
        return self._cursor

    def status(self) -> dict[str, Any]:
        return {"takes": "c" if self._cursor is not None else "python",
                **({"takes_off": self.off} if self.off else {})}


TAKER = FastTake(enabled=os.environ.get("QFORENSICS_REDUCE", "auto").lower() != "eager")


class ForwardHandle:
    """What `wrap_forward` did to a module, undone by `remove()` (like a hook's handle): the
    module's own forward back, and the wrapper off in case anything still holds it."""

    def __init__(self, module: Any, wrapper: Any) -> None:
        self.module, self.wrapper = module, wrapper

    def remove(self) -> None:
        self.wrapper.off = True
        d = self.module.__dict__
        if d.get("forward") is self.wrapper:
            del d["forward"]


def wrap_forward(module: Any, hook: Any) -> ForwardHandle | None:
    """Fold `hook` (called as a forward hook with kwargs and always_call) into the module's
    forward with the extension's Forward; None (register a torch hook instead) when it is not
    built or the module's forward is already an instance attribute (another tool's wrapper,
    such as accelerate's)."""
    typ = TAKER.forward_type
    if typ is None or "forward" in module.__dict__:
        return None
    wrapper = typ(module.forward, module, hook)
    module.__dict__["forward"] = wrapper  # not nn.Module.__setattr__: a plain attribute
    return ForwardHandle(module, wrapper)
