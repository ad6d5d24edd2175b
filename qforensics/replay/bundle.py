"""Replay bundles: one suspect GEMM call, frozen into a small, validated HDF5 file.

A bundle holds the input rows of the tile around the first non-finite output (or the whole
input when small), the weight (dense float [N, K], or AWQ-packed qweight/qzeros/scales with an
optional GPTQ g_idx), the launch shapes, the tile coordinates in the original launch and a
float64 CPU reference output. The on-disk format is specified in docs/replay.md; nothing is
pickled and the reader refuses external links, soft links, external storage and virtual datasets.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from qforensics.errors import ReplayError
from qforensics.replay import awq

FORMAT_NAME = "qforensics-replay-bundle"
FORMAT_VERSION = "1.0"
TILE_M, TILE_N, TILE_K = 8, 64, 32  # the project kernel's tile (kernels/awq_gemm.cu)
SMALL_INPUT_ROWS = 64  # inputs with at most this many rows are kept whole

_FLOAT = (np.float16, np.float32, np.float64)
TENSOR_DTYPES: dict[str, tuple[type, ...]] = {
    "x": _FLOAT,
    "weight": _FLOAT,
    "bias": _FLOAT,
    "qweight": (np.int32,),
    "qzeros": (np.int32,),
    "scales": (np.float16, np.float32),
    "g_idx": (np.int32,),
}


@dataclass
class Bundle:
    """An in-memory replay bundle. `tensors` keys: x, and weight | qweight+qzeros+scales[+g_idx], bias."""

    tensors: dict[str, np.ndarray]
    meta: dict[str, Any]
    reference: np.ndarray | None = None
    observed: np.ndarray | None = None
    path: Path | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def weight_format(self) -> str:
        return str(self.meta["weight_format"])


# ------------------------------------------------------------------------------------------
# building


def _first_nonfinite(snapshot: dict[str, np.ndarray], lead_shape: tuple[int, ...], n: int) -> tuple[int, int] | None:
    pos = snapshot.get("nonfinite_positions")
    if pos is not None and np.asarray(pos).size:
        p = np.asarray(pos, dtype=np.int64)
        if p.ndim != 2 or p.shape[1] != len(lead_shape) + 1:
            raise ReplayError(
                f"nonfinite_positions has shape {p.shape}; expected [n, {len(lead_shape) + 1}] index rows into output.0"
            )
        rows = np.ravel_multi_index(tuple(p[:, :-1].T), lead_shape) if lead_shape else np.zeros(len(p), np.int64)
        order = np.lexsort((p[:, -1], rows))
        return int(rows[order[0]]), int(p[order[0], -1])
    out = snapshot.get("output.0")
    if out is not None:
        o = np.asarray(out).reshape(-1, n) if n else np.asarray(out)
        bad = np.argwhere(~np.isfinite(o))
        if len(bad):
            return int(bad[0, 0]), int(bad[0, 1])
    return None


def _group_size(meta: dict[str, Any], k: int, n_groups: int, has_g_idx: bool) -> int:
    g = meta.get("group_size")
    if g is not None:
        g = int(g)
        return k if g == -1 else g
    if has_g_idx and n_groups:
        return max(1, math.ceil(k / n_groups))
    if n_groups and k % n_groups == 0:
        return k // n_groups
    raise ReplayError(
        f"cannot infer the group size: K={k} is not a multiple of the {n_groups} scale rows; "
        "pass meta['group_size'] (the quant config's group_size)"
    )


def build_bundle(
    snapshot: dict[str, np.ndarray],
    meta: dict[str, Any],
    out_path: str | Path | None = None,
    *,
    small_rows: int = SMALL_INPUT_ROWS,
) -> Bundle:
    """Build a bundle from a snapshot of one GEMM call given as plain numpy arrays.

    snapshot keys: "input.0" ([..., K], required), and "weight" (dense [N, K]) or "qweight",
    "qzeros", "scales" (AWQ layout) with optional "g_idx"; optional "bias", "output.0",
    "nonfinite_positions". meta: optional "group_size", "format", "bits", "call_index",
    "module", "step", "reason", "source". Writes the bundle to out_path when given.
    """
    if "input.0" not in snapshot:
        raise ReplayError("the snapshot has no 'input.0' (the activation); a GEMM replay needs it")
    x_full = np.asarray(snapshot["input.0"])
    if x_full.ndim < 1 or x_full.dtype not in _FLOAT:
        raise ReplayError(f"input.0 must be a float array [..., K], got {x_full.dtype} {x_full.shape}")
    k = int(x_full.shape[-1])
    lead = tuple(int(d) for d in x_full.shape[:-1])
    x2 = x_full.reshape(-1, k)
    m_full = int(x2.shape[0])
    tensors: dict[str, np.ndarray] = {}
    notes: list[str] = []

    if "qweight" in snapshot:
        for name in ("qzeros", "scales"):
            if name not in snapshot:
                raise ReplayError(f"the snapshot has 'qweight' but no '{name}'; an AWQ replay needs all three")
        qweight = np.asarray(snapshot["qweight"])
        qzeros = np.asarray(snapshot["qzeros"])
        scales = np.asarray(snapshot["scales"])
        for name, arr in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
            if arr.ndim != 2:
                raise ReplayError(f"{name} must be 2-D (AWQ layout), got shape {arr.shape}")
        if qweight.dtype.kind not in "iu" or qzeros.dtype.kind not in "iu":
            raise ReplayError(f"qweight/qzeros must be int32 packed words, got {qweight.dtype}/{qzeros.dtype}")
        n = int(qweight.shape[1]) * 8
        if qweight.shape[0] * 8 == k and qweight.shape[1] != k // 8 and scales.shape[1] == qweight.shape[1]:
            raise ReplayError(
                f"qweight {tuple(qweight.shape)} looks GPTQ-packed ([K/8, N]); the replay kernel takes the AWQ "
                "layout ([K, N/8], see docs/replay.md); repack before replaying"
            )
        tensors["qweight"] = _as_words(qweight)
        tensors["qzeros"] = _as_words(qzeros)
        tensors["scales"] = scales if scales.dtype in (np.float16, np.float32) else scales.astype(np.float32)
        n_groups = int(scales.shape[0])
        if "g_idx" in snapshot and snapshot["g_idx"] is not None:
            g = np.asarray(snapshot["g_idx"]).reshape(-1)
            if g.dtype.kind not in "iu":
                raise ReplayError(f"g_idx must be integer, got {g.dtype}")
            if g.size and (g.max() > np.iinfo(np.int32).max or g.min() < np.iinfo(np.int32).min):
                raise ReplayError("g_idx values do not fit int32")
            tensors["g_idx"] = g.astype(np.int32)
        group_size = _group_size(meta, k, n_groups, "g_idx" in tensors)
        weight_format = "gptq" if "g_idx" in tensors else "awq"
        try:
            if qweight.shape[0] != k:
                raise ReplayError(f"qweight has {qweight.shape[0]} rows but the input has K={k}")
            w_kn = awq.dequantize(tensors["qweight"], tensors["qzeros"], tensors["scales"], group_size, tensors.get("g_idx"))
            if w_kn.shape[1] != n or scales.shape[1] != n:
                raise ReplayError(f"scales has {scales.shape[1]} columns, qweight implies N={n}")
        except ReplayError as exc:
            w_kn = None
            notes.append(f"no CPU reference: {exc}")
    elif "weight" in snapshot:
        w = np.asarray(snapshot["weight"])
        if w.ndim != 2 or w.dtype not in _FLOAT:
            raise ReplayError(f"weight must be a float [N, K] array (torch Linear layout), got {w.dtype} {w.shape}")
        n = int(w.shape[0])
        if w.shape[1] != k:
            raise ReplayError(f"weight is [N={w.shape[0]}, {w.shape[1]}] but the input has K={k}")
        tensors["weight"] = w
        n_groups = 0
        group_size = int(meta.get("group_size") or 128)
        if group_size == -1:
            group_size = k
        weight_format = "dense"
        w_kn = w.astype(np.float64).T
    else:
        raise ReplayError("the snapshot has neither 'weight' (dense) nor 'qweight'/'qzeros'/'scales' (AWQ)")

    if "bias" in snapshot and snapshot["bias"] is not None:
        b = np.asarray(snapshot["bias"]).reshape(-1)
        if b.dtype in _FLOAT:
            tensors["bias"] = b

    first = _first_nonfinite(snapshot, lead, n)
    if m_full <= small_rows:
        r0, r1 = 0, m_full
    elif first is not None:
        r0 = (first[0] // TILE_M) * TILE_M
        r1 = min(r0 + TILE_M, m_full)
    else:
        r0, r1 = 0, min(TILE_M, m_full)
    tensors["x"] = np.ascontiguousarray(x2[r0:r1])

    reference = None
    if w_kn is not None:
        reference = tensors["x"].astype(np.float64) @ w_kn
    observed = None
    if "output.0" in snapshot and snapshot["output.0"] is not None:
        o = np.asarray(snapshot["output.0"])
        if o.size == m_full * n:
            observed = np.ascontiguousarray(o.reshape(m_full, n)[r0:r1]).astype(np.float32)

    full_meta: dict[str, Any] = {
        "weight_format": weight_format,
        "quant_format": meta.get("format"),
        "bits": int(meta.get("bits") or (4 if weight_format != "dense" else 0)),
        "M": r1 - r0,
        "M_full": m_full,
        "N": n,
        "K": k,
        "input_shape": list(x_full.shape),
        "group_size": int(group_size),
        "n_groups": int(n_groups),
        "row_start": int(r0),
        "row_stop": int(r1),
        "tile": [TILE_M, TILE_N, TILE_K],
        "tile_m": int(r0 // TILE_M),
        "tile_n": int(first[1] // TILE_N) if first else 0,
        "first_nonfinite": list(first) if first else None,
        "call_index": meta.get("call_index"),
        "step": meta.get("step"),
        "module": meta.get("module"),
        "reason": meta.get("reason"),
        "source": meta.get("source"),
        "notes": notes,
    }
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


def _quant_info(modules: Any, module: str | None) -> dict[str, Any]:
    if modules is None or module is None or not len(modules):
        return {}
    rows = modules[modules["name"] == module]
    if not len(rows):
        return {}
    try:
        info = json.loads(rows.iloc[0]["info"] or "{}")
    except (TypeError, ValueError):
        return {}
    quant = info.get("quant") if isinstance(info, dict) else None
    return quant if isinstance(quant, dict) else {}


def build_bundle_from_trace(
    trace_path: str | Path,
    out_path: str | Path | None = None,
    call_index: int | None = None,
    *,
    open_trace: Callable[[Any], Any] | None = None,
) -> Bundle:
    """Build a bundle from snapshot `call_index` of a trace (default: see choose_call)."""
    if open_trace is None:
        try:
            from qforensics.trace.reader import open_trace as _open
        except ImportError as exc:  # pragma: no cover - the trace reader ships with the package
            raise ReplayError(f"the trace reader is not available ({exc}); pass a replay bundle instead") from exc
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
        row = rows.iloc[0]
        module = str(row["module"]) if "module" in rows.columns else None
        quant = _quant_info(getattr(t, "modules", None), module)
        truncated = bool(rows["truncated"].any()) if "truncated" in rows.columns else False
    if truncated:
        raise ReplayError(
            f"{trace_path}: the snapshot of call {call_index} is truncated (byte budget); "
            "re-record with a larger snapshot budget to replay it"
        )
    meta = {
        "call_index": int(call_index),
        "step": int(row["step"]) if "step" in rows.columns else None,
        "module": module,
        "reason": str(row["reason"]) if "reason" in rows.columns else None,
        "source": str(trace_path),
        "group_size": quant.get("group_size"),
        "bits": quant.get("bits"),
        "format": quant.get("format"),
    }
    return build_bundle(tensors, meta, out_path)


# ------------------------------------------------------------------------------------------
# writing and reading


def write_bundle(bundle: Bundle, path: str | Path) -> Path:
    """Write `bundle` to `path` (HDF5, format in docs/replay.md); returns the path."""
    from qforensics import __version__

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with h5py.File(tmp, "w") as f:
        f.attrs["format"] = FORMAT_NAME
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["created_by"] = f"qforensics {__version__}"
        f.attrs["meta"] = json.dumps(bundle.meta, sort_keys=True)
        g = f.create_group("tensors")
        for name, arr in bundle.tensors.items():
            g.create_dataset(name, data=np.ascontiguousarray(arr))
        if bundle.reference is not None:
            f.create_dataset("reference/y", data=bundle.reference.astype(np.float64))
        if bundle.observed is not None:
            f.create_dataset("observed/y", data=bundle.observed.astype(np.float32))
    tmp.replace(path)
    bundle.path = path
    return path


def _check_links(group: h5py.Group, where: str, path: Path) -> None:
    for name in group:
        link = group.get(name, getlink=True)
        if not isinstance(link, h5py.HardLink):
            raise ReplayError(f"{path}: {where}{name} is a {type(link).__name__}; bundles may hold only hard links")
        obj = group[name]
        if isinstance(obj, h5py.Group):
            _check_links(obj, f"{where}{name}/", path)
        elif isinstance(obj, h5py.Dataset):
            if obj.external or obj.is_virtual:
                raise ReplayError(f"{path}: {where}{name} stores data outside the file; refused")


def is_bundle(path: str | Path) -> bool:
    """True when `path` is an HDF5 file whose root says it is a replay bundle."""
    try:
        with h5py.File(path, "r") as f:
            return f.attrs.get("format") == FORMAT_NAME
    except (OSError, ValueError):
        return False


def read_bundle(path: str | Path) -> Bundle:
    """Read and validate a bundle. Raises ReplayError on anything malformed or unsafe."""
    path = Path(path)
    try:
        f = h5py.File(path, "r")
    except (OSError, ValueError) as exc:
        raise ReplayError(f"{path}: not a readable HDF5 file ({exc})") from exc
    with f:
        if f.attrs.get("format") != FORMAT_NAME:
            raise ReplayError(f"{path}: not a replay bundle (root attribute format != {FORMAT_NAME!r})")
        version = str(f.attrs.get("format_version", ""))
        major = version.split(".")[0]
        if major != FORMAT_VERSION.split(".")[0]:
            raise ReplayError(
                f"{path}: bundle format version {version!r}; this qforensics reads {FORMAT_VERSION.split('.')[0]}.x; "
                "upgrade qforensics to read it"
            )
        _check_links(f, "/", path)
        try:
            meta = json.loads(f.attrs["meta"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ReplayError(f"{path}: root attribute 'meta' is missing or not JSON") from exc
        if not isinstance(meta, dict):
            raise ReplayError(f"{path}: root attribute 'meta' is not a JSON object")
        if "tensors" not in f:
            raise ReplayError(f"{path}: no /tensors group")
        tensors: dict[str, np.ndarray] = {}
        for name in f["tensors"]:
            if name not in TENSOR_DTYPES:
                raise ReplayError(f"{path}: unknown dataset /tensors/{name}")
            ds = f["tensors"][name]
            if ds.dtype not in TENSOR_DTYPES[name]:
                raise ReplayError(f"{path}: /tensors/{name} has dtype {ds.dtype}; allowed: {[np.dtype(d).name for d in TENSOR_DTYPES[name]]}")
            tensors[name] = ds[()]
        reference = f["reference/y"][()] if "reference" in f and "y" in f["reference"] else None
        observed = f["observed/y"][()] if "observed" in f and "y" in f["observed"] else None
    bundle = Bundle(tensors=tensors, meta=meta, reference=reference, observed=observed, path=path,
                    notes=list(meta.get("notes") or []))
    validate_bundle(bundle)
    return bundle


def validate_bundle(bundle: Bundle) -> None:
    """Check shapes and dtypes against the meta; raises ReplayError naming the dataset."""
    m, n, k = bundle.meta.get("M"), bundle.meta.get("N"), bundle.meta.get("K")
    where = str(bundle.path or "bundle")
    for key in ("M", "N", "K", "group_size", "weight_format"):
        if key not in bundle.meta:
            raise ReplayError(f"{where}: meta lacks {key!r}")
    if not all(isinstance(v, int) and v > 0 for v in (m, n, k)):
        raise ReplayError(f"{where}: meta M/N/K must be positive integers, got {m}/{n}/{k}")
    if not isinstance(bundle.meta["group_size"], int) or bundle.meta["group_size"] <= 0:
        raise ReplayError(f"{where}: meta group_size must be a positive integer")
    t = bundle.tensors
    x = t.get("x")
    if x is None or x.ndim != 2 or x.shape != (m, k):
        raise ReplayError(f"{where}: /tensors/x must be [M={m}, K={k}], got {None if x is None else x.shape}")
    fmt = bundle.meta["weight_format"]
    if fmt == "dense":
        w = t.get("weight")
        if w is None or w.shape != (n, k):
            raise ReplayError(f"{where}: /tensors/weight must be [N={n}, K={k}]")
    elif fmt in ("awq", "gptq"):
        for name in ("qweight", "qzeros", "scales"):
            if name not in t or t[name].ndim != 2:
                raise ReplayError(f"{where}: /tensors/{name} must exist and be 2-D")
        if t["qweight"].shape[1] * 8 != n:
            raise ReplayError(f"{where}: /tensors/qweight has {t['qweight'].shape[1]} words per row; N={n} needs {n // 8}")
        if "g_idx" in t and t["g_idx"].ndim != 1:
            raise ReplayError(f"{where}: /tensors/g_idx must be 1-D")
    else:
        raise ReplayError(f"{where}: unknown weight_format {fmt!r}")
    if bundle.reference is not None and bundle.reference.shape != (m, n):
        raise ReplayError(f"{where}: /reference/y must be [M={m}, N={n}], got {bundle.reference.shape}")
    if bundle.reference is not None and bundle.reference.dtype != np.float64:
        raise ReplayError(f"{where}: /reference/y must be float64")
    if bundle.observed is not None and bundle.observed.shape != (m, n):
        raise ReplayError(f"{where}: /observed/y must be [M={m}, N={n}]")


def kernel_tensors(bundle: Bundle) -> tuple[dict[str, np.ndarray], np.ndarray | None, list[str]]:
    """Tensors the project kernel takes (x float16, qweight, qzeros, scales float16[, g_idx]).

    Dense bundles are RTN-quantized to INT4 (group size from meta, else 128); the returned
    reference is then that of the packed weight. Returns (tensors, reference, notes).
    """
    t = bundle.tensors
    notes: list[str] = []
    x16 = t["x"].astype(np.float16)
    over = int(np.count_nonzero(np.isfinite(t["x"]) & ~np.isfinite(x16)))
    if over:
        notes.append(f"{over} input values overflow float16 (the kernel's input type)")
    if bundle.weight_format == "dense":
        g = int(bundle.meta["group_size"])
        w_kn = t["weight"].astype(np.float64).T
        if w_kn.shape[0] % g:
            g = w_kn.shape[0]
        qw, qz, sc = awq.quantize_rtn(w_kn, g)
        out = {"x": x16, "qweight": qw, "qzeros": qz, "scales": sc}
        ref = x16.astype(np.float64) @ awq.dequantize(qw, qz, sc, g)
        notes.append(f"dense weight RTN-quantized to INT4 group_size={g} to run the AWQ kernel")
        return out, ref, notes
    out = {"x": x16, "qweight": t["qweight"], "qzeros": t["qzeros"], "scales": t["scales"].astype(np.float16)}
    if "g_idx" in t:
        out["g_idx"] = t["g_idx"]
    ref = bundle.reference
    if ref is not None and t["x"].dtype != np.float16:
        try:
            ref = x16.astype(np.float64) @ awq.dequantize(
                out["qweight"], out["qzeros"], out["scales"], int(bundle.meta["group_size"]), out.get("g_idx"))
        except ReplayError:
            ref = None
    return out, ref, notes
