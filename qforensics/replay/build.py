"""Building replay bundles: one GEMM call's snapshot (from a trace, or numpy arrays) -> a Bundle.

The layer's tensors go through a layout adapter (qforensics.replay.layouts), which refuses what it
cannot take; the module table of the trace says which layer class, library and kernel the run
used. The rows kept are the whole input (small) or the 8-row tile holding the first non-finite
output; the columns are what capture kept (`weight_rows` / `weight_cols` give a tile's span).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from qforensics.errors import QForensicsError, ReplayError
from qforensics.layouts.detect import detect
from qforensics.replay import layouts
from qforensics.replay.bundle import (
    FLOAT_DTYPES,
    SMALL_INPUT_ROWS,
    TILE_M,
    Bundle,
    write_bundle,
)


def _first_nonfinite(snapshot: dict[str, np.ndarray], lead_shape: tuple[int, ...], n: int) -> tuple[int, int] | None:
    pos = snapshot.get("nonfinite_positions")
    if pos is not None and np.asarray(pos).size:
        p = np.asarray(pos, dtype=np.int64)
        if p.ndim != 2 or p.shape[1] != len(lead_shape) + 1:
            raise ReplayError(
                f"nonfinite_positions has shape {p.shape}; expected [n, {len(lead_shape) + 1}] index rows into output.0"
            )
        if lead_shape and ((p[:, :-1] < 0).any() or (p[:, :-1] >= np.asarray(lead_shape)).any()):
            raise ReplayError(f"nonfinite_positions point outside the output's leading shape {lead_shape}")
        rows = np.ravel_multi_index(tuple(p[:, :-1].T), lead_shape) if lead_shape else np.zeros(len(p), np.int64)
        order = np.lexsort((p[:, -1], rows))
        return int(rows[order[0]]), int(p[order[0], -1])
    out = snapshot.get("output.0")
    if out is not None and n and np.asarray(out).size % n == 0:
        o = np.asarray(out).reshape(-1, n)
        bad = np.argwhere(~np.isfinite(o))
        if len(bad):
            return int(bad[0, 0]), int(bad[0, 1])
    return None


def _span(snapshot: dict[str, np.ndarray], name: str) -> tuple[int, int, int] | None:
    """[start, stop, full] of a weight tile kept by capture (weight_rows / weight_cols)."""
    if name not in snapshot:
        return None
    v = np.asarray(snapshot[name]).reshape(-1)
    if v.size != 3 or v.dtype.kind not in "iu":
        raise ReplayError(f"{name} must be 3 integers [start, stop, full], got {v.dtype} {v.shape}")
    a, b, full = (int(i) for i in v)
    if not 0 <= a < b <= full:
        raise ReplayError(f"{name} = [{a}, {b}, {full}] is not a span inside the weight")
    return a, b, full


_WEIGHT_KEYS = ("weight", "qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale",
                "weight_zero_point", "input_scale")


def build_bundle(
    snapshot: dict[str, np.ndarray],
    meta: dict[str, Any],
    out_path: str | Path | None = None,
    *,
    small_rows: int = SMALL_INPUT_ROWS,
) -> Bundle:
    """Build a bundle from a snapshot of one GEMM call given as plain numpy arrays.

    snapshot keys: "input.0" ([..., K], required); the layer's tensors in one layout of
    qforensics.replay.layouts ("weight" dense [N, K] or FP8 bits; "qweight"/"qzeros"/"scales"
    [+ "g_idx"]; "weight_packed"/"weight_scale"[/"weight_zero_point"]; "input_scale"); optional
    "bias", "output.0", "nonfinite_positions", and "weight_rows"/"weight_cols" when only a tile
    of output columns was kept. meta: "layout", "group_size", "bits", "format", "kernel",
    "compute_dtype", "library", "fake_quant", "weight_dtype", "saturate", "call_index", "module",
    "step", "reason", "source". Writes the bundle to out_path when given.
    """
    if "input.0" not in snapshot:
        raise ReplayError("the snapshot has no 'input.0' (the activation); a GEMM replay needs it")
    x_full = np.asarray(snapshot["input.0"])
    if x_full.ndim < 1 or x_full.dtype not in FLOAT_DTYPES:
        raise ReplayError(f"input.0 must be a float array [..., K], got {x_full.dtype} {x_full.shape}")
    k = int(x_full.shape[-1])
    lead = tuple(int(d) for d in x_full.shape[:-1])
    x2 = x_full.reshape(-1, k)
    m_full = int(x2.shape[0])
    tensors: dict[str, np.ndarray] = {}
    for key in _WEIGHT_KEYS:
        if snapshot.get(key) is not None:
            arr = np.asarray(snapshot[key])
            tensors[key] = _as_words(arr) if key in ("qweight", "qzeros", "weight_packed", "weight_zero_point") else arr
    if "g_idx" in tensors:
        g = tensors["g_idx"].reshape(-1)
        if g.dtype.kind not in "iu":
            raise ReplayError(f"g_idx must be integer, got {g.dtype}")
        if g.size and (g.max() > np.iinfo(np.int32).max or g.min() < np.iinfo(np.int32).min):
            raise ReplayError("g_idx values do not fit int32")
        tensors["g_idx"] = g.astype(np.int32)
    lmeta = {key: meta[key] for key in ("layout", "group_size", "weight_dtype", "weight_block_size", "saturate",
                                        "zero_plus_one", "fake_quant") if meta.get(key) is not None}
    lmeta["K"] = k
    if lmeta.get("group_size") is not None:
        lmeta["group_size"] = int(lmeta["group_size"])
    try:
        layout = layouts.choose_layout(tensors, lmeta)
    except layouts.LayoutError as exc:
        raise ReplayError(f"cannot replay this snapshot: {exc}") from exc
    try:
        w_kn = layout.weight_kn(tensors, lmeta)
    except layouts.LayoutError as exc:
        raise ReplayError(f"cannot replay this snapshot: {exc}") from exc
    n = int(w_kn.shape[1])
    span = _span(snapshot, "weight_rows") or _span(snapshot, "weight_cols")
    col0, n_full = (span[0], span[2]) if span else (0, n)
    if span and span[1] - span[0] != n:
        raise ReplayError(f"the weight tile spans columns [{span[0]}, {span[1]}) but holds {n} output columns")

    first = _first_nonfinite(snapshot, lead, n_full)
    if m_full <= small_rows:
        r0, r1 = 0, m_full
    elif first is not None:
        r0 = (first[0] // TILE_M) * TILE_M
        r1 = min(r0 + TILE_M, m_full)
    else:
        r0, r1 = 0, min(TILE_M, m_full)
    tensors["x"] = np.ascontiguousarray(x2[r0:r1])
    if "bias" in snapshot and snapshot["bias"] is not None:
        b = np.asarray(snapshot["bias"]).reshape(-1)
        if b.dtype in FLOAT_DTYPES and b.size in (n, n_full):
            tensors["bias"] = b[col0:col0 + n] if b.size == n_full and n != n_full else b

    with np.errstate(over="ignore", invalid="ignore"):
        reference = layout.effective_input(tensors["x"], tensors, lmeta) @ w_kn
    observed = None
    notes: list[str] = []
    if snapshot.get("output.0") is not None:
        o = np.asarray(snapshot["output.0"])
        if o.size == m_full * n_full:
            observed = np.ascontiguousarray(o.reshape(m_full, n_full)[r0:r1, col0:col0 + n]).astype(np.float32)
        else:
            notes.append(f"output.0 has {o.size} values, not M*N = {m_full}*{n_full}: not compared")

    full_meta: dict[str, Any] = {
        "layout": layout.name,
        "fixture": layout.fixture,
        "library": meta.get("library"),
        "kernel": meta.get("kernel"),
        "compute_dtype": meta.get("compute_dtype") or (x_full.dtype.name if x_full.dtype != np.float64 else "float32"),
        "quant_format": meta.get("format"),
        "bits": int(meta.get("bits") or (0 if layout.name == "dense" else 4 if layout.name != "fp8" else 8)),
        "M": r1 - r0,
        "M_full": m_full,
        "N": n,
        "N_full": n_full,
        "K": k,
        "input_shape": list(x_full.shape),
        "group_size": int(lmeta.get("group_size") or -1),
        "row_start": int(r0),
        "row_stop": int(r1),
        "col_start": int(col0),
        "col_stop": int(col0 + n),
        "first_nonfinite": list(first) if first else None,
        "call_index": meta.get("call_index"),
        "step": meta.get("step"),
        "module": meta.get("module"),
        "module_type": meta.get("module_type"),
        "library_version": meta.get("library_version"),
        "snapshot_kept": meta.get("snapshot_kept"),
        "reason": meta.get("reason"),
        "source": meta.get("source"),
        "notes": notes,
    }
    full_meta.update({key: v for key, v in lmeta.items() if key not in full_meta})
    full_meta = json.loads(json.dumps(full_meta, default=_jsonable))
    bundle = Bundle(tensors=tensors, meta=full_meta, reference=reference, observed=observed, notes=notes)
    if out_path is not None:
        write_bundle(bundle, out_path)
    return bundle


def _as_words(a: np.ndarray) -> np.ndarray:
    """Any integer array of packed 32-bit words -> int32 (bit pattern kept)."""
    if a.dtype == np.int32:
        return a
    return (a.astype(np.int64) & 0xFFFFFFFF).astype(np.uint32).view(np.int32)


def _jsonable(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    return str(v)


def choose_call(snapshots: Any) -> int:
    """The default call: first snapshot with reason first_nonfinite_output, else first_outlier."""
    for reason in ("first_nonfinite_output", "first_outlier"):
        rows = snapshots[snapshots["reason"] == reason]
        if len(rows):
            return int(rows["call_index"].min())
    raise ReplayError(
        "the trace has no snapshot with reason first_nonfinite_output or first_outlier; "
        "pick a call with --call N (see `qforensics analyze TRACE` for the snapshot list)"
    )


def _module_row(modules: Any, module: str | None) -> tuple[str | None, dict[str, Any]]:
    """(class name, info JSON) of `module` in the trace's module table."""
    if modules is None or module is None or not len(modules):
        return None, {}
    rows = modules[modules["name"] == module]
    if not len(rows):
        return None, {}
    row = rows.iloc[0]
    try:
        info = json.loads(row["info"] or "{}")
    except (TypeError, ValueError):
        info = {}
    mtype = str(row["type"]) if "type" in rows.columns else None
    return mtype, info if isinstance(info, dict) else {}


def layout_meta(mtype: str | None, info: dict[str, Any], snapshot_names: set[str]) -> dict[str, Any]:
    """What the module table says about the layer the run used: layout, library, kernel, dtypes.

    Only facts the trace states are used; the layout is otherwise left to the adapters, which
    refuse what none of them can take.
    """
    quant = info.get("quant") if isinstance(info.get("quant"), dict) else {}
    params = info.get("params") if isinstance(info.get("params"), dict) else {}
    wdt = str((params.get("weight") or {}).get("dtype") or "") if isinstance(params.get("weight"), dict) else ""
    meta: dict[str, Any] = {"module_type": mtype, "group_size": quant.get("group_size"), "bits": quant.get("bits"),
                            "format": quant.get("format")}
    engine = info.get("engine") if isinstance(info.get("engine"), dict) else {}
    if engine.get("layout"):
        meta["layout"] = str(engine["layout"])
    if mtype == "FakeQuantLinear":
        meta.update(layout="qforensics-fakequant", fake_quant=quant.get("format"), kernel="qforensics-fakequant",
                    library="qforensics (fixture: the project's own fake-quant layer)")
        return _dtype_facts(meta, wdt, engine)
    found = detect({n: params.get(n) or {} for n in set(params) | snapshot_names}, mtype or "").name
    if found == "fp8":
        meta.update(layout=meta.get("layout") or "fp8", weight_dtype=wdt, kernel="torch-scaled-mm")
    elif found == "awq-gemm" and "qweight" in snapshot_names and mtype and "WQLinear" in mtype:
        meta.update(layout=meta.get("layout") or "awq-gemm", library="autoawq", kernel=f"autoawq:{mtype}")
    elif found == "ct-pack-quantized" and "weight_packed" in snapshot_names:
        meta.update(layout=meta.get("layout") or "ct-pack-quantized", library="compressed-tensors")
    elif found in ("dense", "") and mtype in ("Linear", "NonDynamicallyQuantizableLinear") and "weight" in snapshot_names:
        meta.update(layout="dense", kernel="torch-linear", library="torch")
    return _dtype_facts(meta, wdt, engine)


def _dtype_facts(meta: dict[str, Any], wdt: str, engine: dict[str, Any]) -> dict[str, Any]:
    """The compute dtype (a float weight's) and the engine's own kernel name, when stated."""
    if wdt in ("float32", "float16", "bfloat16"):
        meta["compute_dtype"] = wdt
    if engine.get("kernel"):
        meta["kernel"] = str(engine["kernel"])
    return meta


def _call_facts(raw: np.ndarray | None, where: Any) -> dict[str, Any]:
    """The `call.json` capture keeps beside a snapshot (class, library and version, dtypes,
    layout hints), bounded and checked; {} for traces written before it existed."""
    if raw is None:
        return {}
    from qforensics.trace.validate import parse_json

    try:
        facts = parse_json(np.asarray(raw, dtype=np.uint8).tobytes(), f"{where}: snapshot call.json")
    except QForensicsError as exc:
        raise ReplayError(str(exc)) from exc
    if not isinstance(facts, dict):
        raise ReplayError(f"{where}: snapshot call.json is not a JSON object")
    return {k: v for k, v in facts.items() if isinstance(v, (str, int, float, bool, dict, list)) or v is None}


def build_bundle_from_trace(
    trace_path: str | Path,
    out_path: str | Path | None = None,
    call_index: int | None = None,
    *,
    open_trace: Callable[[Any], Any] | None = None,
) -> Bundle:
    """Build a bundle from snapshot `call_index` of a trace (default: see choose_call)."""
    if open_trace is None:
        from qforensics.trace.reader import open_trace as _open

        open_trace = _open
    with open_trace(trace_path) as t:
        snaps = t.snapshots
        if call_index is None:
            call_index = choose_call(snaps)
        rows = snaps[snaps["call_index"] == call_index]
        if not len(rows):
            have = sorted({int(c) for c in snaps["call_index"]})
            raise ReplayError(f"{trace_path}: no snapshot for call {call_index}; calls with snapshots: {have}")
        tensors = t.snapshot_tensors(call_index)
        facts = _call_facts(tensors.pop("call.json", None), trace_path)
        row = rows.iloc[0]
        module = str(row["module"]) if "module" in rows.columns else None
        mtype, info = _module_row(getattr(t, "modules", None), module)
        truncated = bool(rows["truncated"].any()) if "truncated" in rows.columns else False
    if truncated:
        raise ReplayError(
            f"{trace_path}: the snapshot of call {call_index} is truncated (byte budget); "
            "re-record with a larger snapshot budget to replay it"
        )
    meta = layout_meta(facts.get("module_type") or mtype, info, set(tensors))
    meta.update({key: facts[key] for key in ("layout", "kernel", "library", "library_version") if facts.get(key)})
    wdt = (facts.get("params") or {}).get("weight", {}).get("dtype") if isinstance(facts.get("params"), dict) else None
    if isinstance(wdt, str) and wdt.startswith("float8"):
        meta.update(layout=meta.get("layout") or "fp8", weight_dtype=wdt)
    if facts.get("input_dtype") in ("float16", "bfloat16", "float32"):
        meta["compute_dtype"] = facts["input_dtype"]
    meta["snapshot_kept"] = facts.get("kept")
    meta.update({
        "call_index": int(call_index),
        "step": int(row["step"]) if "step" in rows.columns else None,
        "module": module,
        "reason": str(row["reason"]) if "reason" in rows.columns else None,
        "source": str(trace_path),
    })
    return build_bundle(tensors, meta, out_path)
