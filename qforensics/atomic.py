"""The one atomic write: fill a temporary path beside the target, then rename it into place.

A reader (another process polling for the file, a browser reloading a report, a second build of
the same kernel) sees the old target or the whole new one, never half of it. `replacing` yields
the temporary path (a file the caller writes, or an empty folder it fills) and renames it onto
the target with `os.replace` when the block ends; when the block raises, the temporary is
removed and the error goes on. `write_text` and `write_bytes` are the common cases. Standard
library only.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

__all__ = ["replacing", "write_bytes", "write_text"]


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


@contextlib.contextmanager
def replacing(dst: str | os.PathLike[str], *, suffix: str = "", directory: bool = False,
              keep_existing: bool = False) -> Iterator[Path]:
    """A fresh temporary path beside `dst` (same folder, so the rename is atomic; a name no
    other process picks, ending in `suffix`), renamed onto `dst` when the block ends.

    `directory`: the temporary is an empty folder, made here (with its parents). A folder
    cannot replace a folder that is already there: with `keep_existing`, when another process
    got there first, theirs stays and ours is dropped."""
    target = Path(dst)
    tmp = target.with_name(f"{target.name}.{os.getpid()}-{secrets.token_hex(8)}.tmp{suffix}")
    if directory:
        tmp.mkdir(parents=True)
    try:
        yield tmp
        try:
            os.replace(tmp, target)
        except OSError:
            if not (keep_existing and target.exists()):
                raise
    finally:
        _remove(tmp)  # nothing left to remove after the rename


def write_text(dst: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> Path:
    """Write `text` to `dst` atomically; returns `dst` as a Path."""
    with replacing(dst) as tmp:
        tmp.write_text(text, encoding=encoding)
    return Path(dst)


def write_bytes(dst: str | os.PathLike[str], data: bytes) -> Path:
    """Write `data` to `dst` atomically; returns `dst` as a Path."""
    with replacing(dst) as tmp:
        tmp.write_bytes(data)
    return Path(dst)
