"""`python -m qforensics.replay.launcher`: run a user's own op on a bundle's tensors.

    python -m qforensics.replay.launcher --bundle B.h5 --launcher pkg.mod:fn --out DIR

`fn(tensors: dict[str, numpy.ndarray], meta: dict)` launches the user's kernel (their AWQ/GPTQ
extension or Triton kernel) and may return the output (numpy array or torch tensor). This entry
point is what compute-sanitizer runs; its marker lines tell the parent the launch finished.
Exit codes: 0 done, 2 bad bundle or launcher spec, 5 the launcher raised.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from qforensics.errors import QForensicsError, ReplayError

DONE_MARKER = "qforensics-launcher: done"


def load_launcher(spec: str) -> Callable[..., Any]:
    """'package.module:function' -> the callable. ReplayError when it cannot be imported."""
    mod, sep, fn = spec.partition(":")
    if not sep or not mod or not fn:
        raise ReplayError(f"--launcher {spec!r}: expected 'package.module:function'")
    try:
        module = importlib.import_module(mod)
    except ImportError as exc:
        raise ReplayError(f"--launcher {spec!r}: cannot import {mod} ({exc})") from exc
    obj: Any = module
    for part in fn.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ReplayError(f"--launcher {spec!r}: {mod} has no attribute {fn}")
    if not callable(obj):
        raise ReplayError(f"--launcher {spec!r}: {fn} is not callable")
    return obj


def _to_numpy(out: Any) -> np.ndarray | None:
    if out is None:
        return None
    if hasattr(out, "detach"):
        out = out.detach()
    if hasattr(out, "float") and hasattr(out, "cpu"):
        out = out.float().cpu().numpy()
    return np.asarray(out, dtype=np.float32)


def _synchronize() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    from qforensics.replay.bundle import read_bundle

    p = argparse.ArgumentParser(prog="python -m qforensics.replay.launcher")
    p.add_argument("--bundle", required=True)
    p.add_argument("--launcher", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    try:
        bundle = read_bundle(args.bundle)
        fn = load_launcher(args.launcher)
    except QForensicsError as exc:
        sys.stderr.write(f"qforensics-launcher: error: {exc}\n")
        return 2
    print(f"qforensics-launcher: calling {args.launcher}", flush=True)
    try:
        out = fn(dict(bundle.tensors), dict(bundle.meta))
        _synchronize()
        arr = _to_numpy(out)
    except Exception:  # the user's op failing is the finding; report it, keep the traceback
        traceback.print_exc()
        print("qforensics-launcher: raised", flush=True)
        return 5
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stated = getattr(fn, "error_bound", None)  # the launcher's own error bound (replay/bounds.py)
    if stated is not None:
        (out_dir / "bound.json").write_text(json.dumps(stated))
    if arr is not None:
        arr.astype("<f4").tofile(out_dir / "y.bin")
        print(f"qforensics-launcher: output shape {list(arr.shape)}", flush=True)
    print(DONE_MARKER, flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
