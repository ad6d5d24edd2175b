"""The weight layouts a replay understands, and which one a snapshot holds.

The layouts themselves (dense, awq-gemm, gptq, ct-pack-quantized, fp8, vllm-cpu-w4a16; what
their tensors are and how they dequantize) live in qforensics.layouts, the one place that knows
them. Replay adds its fixture, the project's own fake-quant layer (``qforensics-fakequant``:
a dense weight plus an activation scheme such as ``fp8-e4m3-nosat``; never a user's kernel),
and `choose_layout`: the layout the trace names (checked), else the one whose tensors are
present; one nobody can take is refused with every adapter's reason, never guessed.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from qforensics.layouts import registry
from qforensics.layouts.bits import LayoutError
from qforensics.layouts.fp8 import FP8_MAX, quantize_fp8
from qforensics.layouts.registry import NAMED_ONLY, REPACKED, Layout, dense_check, dense_w

__all__ = ["LAYOUTS", "Layout", "LayoutError", "choose_layout"]

_FAKE_RE = re.compile(r"^fp8-(e4m3|e4m3fn|e5m2)((?:-(?:nosat|dynamic))*)$")


def _fake_check(t: dict[str, np.ndarray], meta: dict[str, Any]) -> str | None:
    why = dense_check(t, meta)
    if why:
        return why
    fmt = str(meta.get("fake_quant") or "")
    if not _FAKE_RE.match(fmt):
        return f"activation scheme {fmt!r} has no float64 reference here (known: fp8-e4m3|e5m2[-nosat][-dynamic])"
    return None


def _fake_input(x: np.ndarray, t: dict[str, np.ndarray], meta: dict[str, Any]) -> np.ndarray:
    m = _FAKE_RE.match(str(meta["fake_quant"]))
    assert m is not None  # can_take checked it
    dt = "float8_e5m2" if m.group(1) == "e5m2" else "float8_e4m3fn"
    mods = m.group(2)
    scale = 1.0
    if "dynamic" in mods:
        amax = float(np.nanmax(np.abs(np.where(np.isfinite(x), x, 0.0)))) if x.size else 0.0
        scale = amax / FP8_MAX[dt] if amax > 0 else 1.0
    return quantize_fp8(x / scale, dt, saturate="nosat" not in mods) * scale


LAYOUTS: dict[str, Layout] = {
    **registry.LAYOUTS,
    "qforensics-fakequant": Layout("qforensics-fakequant", ("weight",), _fake_check, dense_w, _fake_input,
                                   fixture=True),
}


def choose_layout(tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> Layout:
    """The layout named in meta['layout'] (checked), else the one whose tensors are present.

    Raises LayoutError with every adapter's reason when none can take the snapshot.
    """
    name = meta.get("layout")
    if name in REPACKED:
        raise LayoutError(f"layout {name!r} is refused: {REPACKED[name]}; record the checkpoint's tensors "
                          "before repacking (or replay the checkpoint's layer) instead")
    if name is not None and name not in LAYOUTS:
        raise LayoutError(f"unknown layout {name!r}; known: {', '.join(LAYOUTS)}")
    candidates = [LAYOUTS[name]] if name else list(LAYOUTS.values())
    reasons = []
    for lay in candidates:
        if (lay.fixture or lay.name in NAMED_ONLY) and name is None:
            continue  # chosen only when the trace names them
        why = lay.can_take(tensors, meta)
        if not why:
            return lay
        reasons.append(why)
    raise LayoutError("no layout can take this snapshot: " + "; ".join(reasons))
