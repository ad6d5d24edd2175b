"""The numeric leg of a replay: the kernel's output on the recorded data against the float64
reference, turned into KERNEL DIVERGES, DATA or NOT REPRODUCED, with the evidence.

- KERNEL DIVERGES: where the reference is finite, the kernel's output is non-finite or further
  from it than the stated tolerance (coordinates, count, worst error).
- DATA: the kernel agrees with the reference and the reference itself is non-finite: the
  recorded input or parameters make the NaN. The channels, groups or rows responsible are named.
- NOT REPRODUCED: the kernel agrees with a finite reference; the recorded failure did not recur
  on this data through this kernel.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from qforensics.replay.bundle import Bundle
from qforensics.layouts.fp8 import FP8_MAX
from qforensics.replay.bounds import BoundModel, model_for
from qforensics.replay.torch_kernels import KERNELS, cuda_matmul_flags
from qforensics.replay.verdict import ReplayResult, Verdict

_TOP = 5


def _coords(mask: np.ndarray, bundle: Bundle) -> list[list[int]]:
    """First few [row, column] of `mask` in the coordinates of the original launch."""
    r0, c0 = int(bundle.meta.get("row_start", 0)), int(bundle.meta.get("col_start", 0))
    return [[int(r) + r0, int(c) + c0] for r, c in np.argwhere(mask)[:_TOP]]


def explain_data(bundle: Bundle, x_seen: np.ndarray, w_kn: np.ndarray) -> tuple[str, dict[str, Any]]:
    """Why the float64 reference is non-finite: which inputs, channels, groups or rows."""
    x = np.asarray(bundle.tensors["x"], dtype=np.float64)
    facts: dict[str, Any] = {}
    parts: list[str] = []
    bad_x = ~np.isfinite(x)
    if bad_x.any():
        ch = np.flatnonzero(bad_x.any(axis=0))
        facts["nonfinite_input_channels"] = ch[:_TOP].tolist()
        parts.append(f"the recorded input is already non-finite in {len(ch)} channel(s) "
                     f"({', '.join(map(str, ch[:_TOP]))})")
    made = ~np.isfinite(x_seen) & ~bad_x
    if made.any():
        ch = np.flatnonzero(made.any(axis=0))
        amax = np.max(np.abs(np.where(made, x, 0.0)), axis=0)[ch]
        order = np.argsort(-amax)[:_TOP]
        top = FP8_MAX["float8_e4m3fn"]
        facts["overflowing_input_channels"] = [{"channel": int(ch[i]), "absmax": float(amax[i])} for i in order]
        facts["format_max"] = top
        scale = bundle.tensors.get("input_scale")
        s = float(np.asarray(scale).reshape(-1)[0]) if scale is not None else 1.0
        listed = ", ".join(f"{int(ch[i])} ({amax[i]:,.0f})" for i in order)
        parts.append(f"the activation quantization turns {int(made.sum())} finite input value(s) into NaN: "
                     f"channel(s) {listed} exceed the format's range {top:g} x input scale {s:g} = {top * s:,.0f}")
    bad_w = ~np.isfinite(w_kn)
    if bad_w.any():
        k_rows = np.flatnonzero(bad_w.any(axis=1))
        cols = np.flatnonzero(bad_w.any(axis=0))
        g = int(bundle.meta.get("group_size") or -1)
        g = int(bundle.meta["K"]) if g == -1 else g
        groups = sorted({int(k) // g for k in k_rows})
        c0 = int(bundle.meta.get("col_start", 0))
        facts["nonfinite_weight"] = {"input_rows": k_rows[:_TOP].tolist(), "groups": groups[:_TOP],
                                     "output_columns": (cols[:_TOP] + c0).tolist(), "count": int(bad_w.sum())}
        param = next((p for p in ("scales", "weight_scale", "qzeros", "weight") if p in bundle.tensors
                      and bundle.tensors[p].dtype.kind == "f" and not np.isfinite(bundle.tensors[p]).all()), None)
        where = f" ({param} holds non-finite values)" if param else ""
        parts.append(f"the dequantized weight is non-finite in {int(bad_w.sum())} entries{where}: group(s) "
                     f"{', '.join(map(str, groups[:_TOP]))} of size {g}, output column(s) "
                     f"{', '.join(map(str, (cols[:_TOP] + c0).tolist()))}")
    if not parts:
        parts.append("the float64 product overflows although inputs and weight are finite")
        facts["overflow"] = True
    return "; ".join(parts), facts


def _resolve_bound(bundle: Bundle, kernel_name: str, kernel: str | None, device: str | None,
                   bound: BoundModel | str | None) -> tuple[BoundModel | None, str]:
    if isinstance(bound, BoundModel):
        return bound, ""
    if bound is None:
        return None, f"{kernel_name} states no error bound"
    kid = kernel or next((k for k in KERNELS if kernel_name == k or kernel_name.startswith(k + " ")), None)
    if kid is None:
        return None, (f"{kernel_name} is not one of qforensics' kernels and states no error bound (a --launcher "
                      "function states one with an `error_bound` attribute, docs/replay.md)")
    dev = device or ("cuda" if "(CUDA)" in kernel_name else "cpu")
    x = bundle.tensors.get("x")
    w = bundle.tensors.get("weight")
    return model_for(kid, dev, bundle.meta, x_stored=str(x.dtype) if x is not None else None,
                     w_stored=str(w.dtype) if w is not None and bundle.layout.name == "dense" else None,
                     cuda_flags=cuda_matmul_flags() if dev == "cuda" else None)


def _weight_magnitudes(bundle: Bundle, w_kn: np.ndarray, model: BoundModel) -> np.ndarray:
    """A_kn >= |w_kn|: what the kernel's weight operand is built from (tinygemm: (q - 8) * scale and
    zero, each rounded on its own), non-finite entries as 0 (they are DATA, judged apart)."""
    a = np.abs(w_kn)
    if model.name.startswith("tinygemm"):
        from qforensics.replay.torch_kernels import int4_qzs

        q, z, s, g = int4_qzs(bundle.tensors, bundle.meta, bundle.layout)
        idx = np.arange(q.shape[0]) // g
        with np.errstate(over="ignore", invalid="ignore"):
            a = np.abs(q - 8.0) * np.abs(s[idx]) + np.abs((8.0 - z[idx]) * s[idx])
    return np.where(np.isfinite(a), a, 0.0)


def _no_bound(bundle: Bundle, ref: np.ndarray, y: np.ndarray, kernel_name: str, path: str, why: str) -> ReplayResult:
    """No stated bound: never KERNEL DIVERGES; what was measured is reported, not judged."""
    ref_ok, y_ok = np.isfinite(ref), np.isfinite(y)
    both = ref_ok & y_ok
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(y - ref)
    details: dict[str, Any] = {"kernel": kernel_name, "tolerance": None, "bound_model": None, "bound_missing": why,
                               "compared": int(ref.size), "reference_nonfinite": int((~ref_ok).sum()),
                               "kernel_nonfinite": int((~y_ok).sum()),
                               "nonfinite_where_reference_finite": int((ref_ok & ~y_ok).sum())}
    if both.any():
        details["max_abs_err"] = float(err[both].max())
    summary = (f"{kernel_name} ran on the recorded tile but has no stated error bound, so it is not judged: {why}. "
               f"Measured: max |err| {details.get('max_abs_err', float('nan')):.3g} against the float64 reference, "
               f"{details['nonfinite_where_reference_finite']} non-finite output(s) where the reference is finite, "
               f"{details['reference_nonfinite']} non-finite reference output(s)")
    return ReplayResult(Verdict.INCONCLUSIVE, path, summary, reason="no stated error bound", details=details)


def judge_numeric(bundle: Bundle, y_kernel: np.ndarray, kernel_name: str, *, path: str = "kernel",
                  kernel: str | None = None, device: str | None = None,
                  bound: BoundModel | str | None = "auto", no_bound_reason: str | None = None) -> ReplayResult:
    """Compare the kernel's output with the bundle's float64 reference and give the verdict.

    The tolerance is the kernel's own bound model (qforensics.replay.bounds): bound="auto" finds it
    from `kernel` (or the KERNELS name `kernel_name` starts with) and `device` (or "(CUDA)" in the
    name); a BoundModel is used as given; None (or an unknown kernel) means no stated bound, which
    reads INCONCLUSIVE, never KERNEL DIVERGES."""
    ref = bundle.reference
    layout = bundle.layout
    x_seen = layout.effective_input(bundle.tensors["x"], bundle.tensors, bundle.meta)
    w_kn = layout.weight_kn(bundle.tensors, bundle.meta)
    if ref is None:
        with np.errstate(over="ignore", invalid="ignore"):
            ref = x_seen @ w_kn
    y = np.asarray(y_kernel, dtype=np.float64)
    if y.shape != ref.shape:
        return ReplayResult(Verdict.INCONCLUSIVE, path,
                            f"{kernel_name} returned shape {list(y.shape)}, the reference is {list(ref.shape)}",
                            reason="output shape mismatch")
    model, why = _resolve_bound(bundle, kernel_name, kernel, device, bound)
    why = no_bound_reason or why
    k = int(x_seen.shape[-1])
    if model is not None and not math.isfinite(model.coefficients(k)[0]):
        why, model = f"{model.statement(k)} is no bound at K={k} (n u >= 1)", None
    if model is None:
        return _no_bound(bundle, ref, y, kernel_name, path, why)
    finite_x = np.where(np.isfinite(x_seen), np.abs(x_seen), 0.0)
    mags = _weight_magnitudes(bundle, w_kn, model)
    with np.errstate(over="ignore", invalid="ignore"):
        tol = model.evaluate(finite_x @ mags, ref, k)
    stated = model.statement(k)
    ref_ok = np.isfinite(ref)
    y_ok = np.isfinite(y)
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(y - ref)
    bad_nan = ref_ok & ~y_ok
    bad_far = ref_ok & y_ok & (err > tol)
    details: dict[str, Any] = {"kernel": kernel_name, "tolerance": stated, "bound_model": model.to_dict(k),
                               "compared": int(ref.size),
                               "reference_nonfinite": int((~ref_ok).sum()), "kernel_nonfinite": int((~y_ok).sum())}
    both = ref_ok & y_ok
    if both.any():
        details["max_abs_err"] = float(err[both].max())
        details["max_err_over_tolerance"] = float((err[both] / tol[both]).max())
    if bad_nan.any() or bad_far.any():
        mask = bad_nan | bad_far
        details.update(diverging=int(mask.sum()), first=_coords(mask, bundle), nonfinite_where_reference_finite=int(bad_nan.sum()))
        what = (f"{int(bad_nan.sum())} non-finite output(s) where the reference is finite" if bad_nan.any() else "")
        if bad_far.any():
            worst = np.unravel_index(np.argmax(np.where(bad_far, err / tol, 0.0)), err.shape)
            at = [int(worst[0]) + int(bundle.meta.get("row_start", 0)), int(worst[1]) + int(bundle.meta.get("col_start", 0))]
            far = (f"{int(bad_far.sum())} output(s) beyond tolerance (worst at {at}: "
                   f"|err| {err[worst]:.4g} > {tol[worst]:.4g})")
            what = f"{what}; {far}" if what else far
        summary = (f"{kernel_name} on the recorded tile (M={bundle.meta['M']} N={bundle.meta['N']} K={bundle.meta['K']}, "
                   f"rows [{bundle.meta.get('row_start', 0)}, {bundle.meta.get('row_stop')}), columns "
                   f"[{bundle.meta.get('col_start', 0)}, {bundle.meta.get('col_stop')})): {what}; first at "
                   f"{details['first'][0]}; tolerance {stated}")
        return ReplayResult(Verdict.KERNEL_DIVERGES, path, summary, errors=int(mask.sum()), details=details,
                            bound_model=details["bound_model"])
    if not ref_ok.all():
        agree = bool(np.array_equal(~ref_ok, ~y_ok))
        why, facts = explain_data(bundle, x_seen, w_kn)
        details.update(facts=facts, kernel_matches_reference_nonfinite=agree, first=_coords(~ref_ok, bundle))
        summary = (f"{kernel_name} agrees with the float64 reference, which is itself non-finite in "
                   f"{int((~ref_ok).sum())} of {ref.size} outputs (first at {details['first'][0]}): {why}")
        return ReplayResult(Verdict.DATA, path, summary, errors=int((~ref_ok).sum()), details=details,
                            bound_model=details["bound_model"])
    observed = bundle.observed
    seen_bad = int((~np.isfinite(observed)).sum()) if observed is not None else 0
    details["observed_nonfinite"] = seen_bad
    tail = (f"; the trace recorded {seen_bad} non-finite output(s) here, which this kernel does not reproduce "
            "on the recorded data (another kernel, another launch, or a fault a sanitizer run may catch)"
            if seen_bad else "")
    summary = (f"{kernel_name} agrees with the finite float64 reference on all {ref.size} outputs "
               f"(max |err| {details.get('max_abs_err', 0.0):.3g}, within {stated}){tail}")
    return ReplayResult(Verdict.NOT_REPRODUCED, path, summary, details=details, bound_model=details["bound_model"])
