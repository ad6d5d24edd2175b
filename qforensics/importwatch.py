"""Run a callback right after a module is imported, without importing it first (torch-free).

`AfterImport(names, callback, on_error, once)` is a meta-path finder: when one of `names` is
imported it finds the real spec, wraps the loader's `exec_module`, and calls `callback(module)`
once the module has executed. A callback that raises goes to `on_error(fullname, exc)`: the
import itself never breaks. With `once`, the finder removes itself at its first match.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Collection
from typing import Any


class AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, names: Collection[str], callback: Callable[[Any], None],
                 on_error: Callable[[str, Exception], None], *, once: bool = False) -> None:
        self.names = names
        self.callback = callback
        self.on_error = on_error
        self.once = once

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.names:
            return None
        if self.once and self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        orig = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            orig(module)
            try:
                self.callback(module)
            except Exception as exc:  # never break the user's import
                self.on_error(fullname, exc)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
