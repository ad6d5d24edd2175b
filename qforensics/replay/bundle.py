"""Replay bundles: one suspect GEMM call, frozen into a small, validated HDF5 file (built by
qforensics.replay.build).

A bundle holds the input rows of the tile around the first non-finite output (or the whole
input when small), the weight (dense float [N, K], or AWQ-packed qweight/qzeros/scales with an
optional GPTQ g_idx), the launch shapes, the tile coordinates in the original launch and a
float64 CPU reference output. The on-disk format is specified in docs/replay.md; nothing is
pickled and the reader refuses external links, soft links, external storage and virtual datasets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from qforensics.errors import QForensicsError, ReplayError
from qforensics.layouts import awq
from qforensics.replay import layouts
from qforensics.trace import validate

FORMAT_NAME = "qforensics-replay-bundle"
FORMAT_VERSION = "2.0"
TILE_M, TILE_N, TILE_K = 8, 64, 32  # the project kernel's tile (kernels/awq_gemm.cu)
SMALL_INPUT_ROWS = 64  # inputs with at most this many rows are kept whole

FLOAT_DTYPES = (np.float16, np.float32, np.float64)
_WORDS = (np.int32,)
TENSOR_DTYPES: dict[str, tuple[type, ...]] = {
    "x": FLOAT_DTYPES,
    "weight": (*FLOAT_DTYPES, np.uint8),  # uint8: FP8 bit patterns (meta weight_dtype)
    "weight_packed": _WORDS,
    "weight_scale": (np.float16, np.float32, np.float64),
    "weight_zero_point": _WORDS,
    "input_scale": (np.float16, np.float32, np.float64),
    "bias": FLOAT_DTYPES,
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
    def layout(self) -> layouts.Layout:
        return layouts.LAYOUTS[str(self.meta["layout"])]


# ------------------------------------------------------------------------------------------
# writing and reading


def write_bundle(bundle: Bundle, path: str | Path) -> Path:
    """Write `bundle` to `path` (HDF5, format in docs/replay.md); returns the path."""
    from qforensics.version import __version__

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


def is_bundle(path: str | Path) -> bool:
    """True when `path` is an HDF5 file whose root says it is a replay bundle."""
    if validate.non_regular_kind(path) is not None:
        return False  # a FIFO or device is never opened; the reader then refuses it by name
    try:
        with h5py.File(path, "r") as f:
            return f.attrs.get("format") == FORMAT_NAME
    except (OSError, RuntimeError, KeyError, ValueError, TypeError):
        return False


_H5_ERRORS = (OSError, RuntimeError, KeyError, ValueError, TypeError, OverflowError)


def read_bundle(path: str | Path) -> Bundle:
    """Read and validate a bundle. Raises ReplayError on anything malformed, damaged or unsafe."""
    path = Path(path)
    try:
        return _read_bundle(path)
    except ReplayError:
        raise
    except _H5_ERRORS as exc:  # h5py's errors on a damaged file: the file is unreadable, not our crash
        raise ReplayError(f"{path}: damaged or unreadable bundle ({type(exc).__name__}: {str(exc)[:200]})") from exc


def _read_bundle(path: Path) -> Bundle:
    try:
        f, cut = validate.open_hdf5(str(path), "replay bundle")
    except QForensicsError as exc:
        raise ReplayError(str(exc)) from exc
    with f:
        if cut:
            raise ReplayError(f"{path}: cut short ({cut}); a bundle must be whole")
        if f.attrs.get("format") != FORMAT_NAME:
            raise ReplayError(f"{path}: not a replay bundle (root attribute format != {FORMAT_NAME!r})")
        version = str(f.attrs.get("format_version", ""))
        major = version.split(".")[0]
        if major != FORMAT_VERSION.split(".")[0]:
            raise ReplayError(
                f"{path}: bundle format version {version!r}; this qforensics reads {FORMAT_VERSION.split('.')[0]}.x; "
                "upgrade qforensics to read it"
            )
        try:
            unreadable = validate.check_self_contained(f, str(path))
            if unreadable:
                raise ReplayError(f"{path}: damaged: cannot list {', '.join(unreadable[:3])}")
            if "meta" not in f.attrs:
                raise ReplayError(f"{path}: root attribute 'meta' is missing")
            meta = validate.parse_json(f.attrs["meta"], f"{path}: root attribute 'meta'")
        except QForensicsError as exc:
            raise ReplayError(str(exc)) from exc
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


_META_TYPES: dict[str, tuple[type, ...]] = {
    "layout": (str,), "fixture": (bool,), "library": (str, type(None)), "kernel": (str, type(None)),
    "compute_dtype": (str,), "fake_quant": (str, type(None)), "weight_dtype": (str, type(None)),
    "saturate": (bool,), "zero_plus_one": (bool,), "module": (str, type(None)), "notes": (list,),
    "weight_block_size": (list, type(None)), "first_nonfinite": (list, type(None)),
    "library_version": (str, type(None)), "snapshot_kept": (str, type(None)),
}
_META_INTS = ("M_full", "N_full", "row_start", "row_stop", "col_start", "col_stop")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_meta_types(meta: dict[str, Any], where: str) -> None:
    for key, types in _META_TYPES.items():
        if key in meta and not isinstance(meta[key], types):
            raise ReplayError(f"{where}: meta {key!r} must be {' or '.join(t.__name__ for t in types)}, "
                              f"got {type(meta[key]).__name__}")
    for key in _META_INTS:
        if key in meta and not (_is_int(meta[key]) and 0 <= meta[key] < 2**40):
            raise ReplayError(f"{where}: meta {key!r} must be a non-negative integer, got {meta[key]!r}")
    blk = meta.get("weight_block_size")
    if blk is not None and not (len(blk) == 2 and all(_is_int(b) and 0 < b < 2**20 for b in blk)):
        raise ReplayError(f"{where}: meta 'weight_block_size' must be two positive integers, got {blk!r}")
    if meta.get("compute_dtype") not in (None, "float16", "bfloat16", "float32", "float64"):
        raise ReplayError(f"{where}: meta 'compute_dtype' {meta['compute_dtype']!r} is not a float dtype")


def validate_bundle(bundle: Bundle) -> None:
    """Check the meta, the layout's own shape rules and the reference/observed shapes; raises
    ReplayError naming what contradicts what."""
    meta = bundle.meta
    where = str(bundle.path or "bundle")
    for key in ("M", "N", "K", "layout"):
        if key not in meta:
            raise ReplayError(f"{where}: meta lacks {key!r}")
    m, n, k = meta["M"], meta["N"], meta["K"]
    if not all(_is_int(v) and 0 < v < 2**40 for v in (m, n, k)):
        raise ReplayError(f"{where}: meta M/N/K must be positive integers, got {m!r}/{n!r}/{k!r}")
    g = meta.get("group_size", -1)
    if not _is_int(g) or not (g == -1 or 0 < g <= k):
        raise ReplayError(f"{where}: meta group_size must be -1 or an integer in 1..K, got {g!r}")
    _check_meta_types(meta, where)
    if meta["layout"] not in layouts.LAYOUTS:
        raise ReplayError(f"{where}: unknown layout {meta['layout']!r}; known: {', '.join(layouts.LAYOUTS)}")
    x = bundle.tensors.get("x")
    if x is None or x.ndim != 2 or x.shape != (m, k):
        raise ReplayError(f"{where}: /tensors/x must be [M={m}, K={k}], got {None if x is None else x.shape}")
    why = bundle.layout.can_take(bundle.tensors, meta)
    if why:
        raise ReplayError(f"{where}: the tensors contradict the meta: {why}")
    try:
        w_n = bundle.layout.weight_kn(bundle.tensors, meta).shape[1]
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, ReplayError) as exc:
        raise ReplayError(f"{where}: the weight cannot be dequantized: {exc}") from exc
    if w_n != n:
        raise ReplayError(f"{where}: the weight holds {w_n} output columns, meta N={n}")
    for label, arr, dt in (("reference", bundle.reference, np.float64), ("observed", bundle.observed, np.float32)):
        if arr is not None and (arr.shape != (m, n) or arr.dtype != dt):
            raise ReplayError(f"{where}: /{label}/y must be {np.dtype(dt).name} [M={m}, N={n}], got {arr.dtype} {arr.shape}")


def kernel_tensors(bundle: Bundle) -> tuple[dict[str, np.ndarray], np.ndarray | None, list[str]]:
    """Tensors the project's CUDA kernel takes (x float16, qweight, qzeros, scales float16[, g_idx]).

    Only AWQ-GEMM bundles run on it directly. This is the path of the checked reference kernel and
    of the planted-bug fixture, never the kernel under judgement for a user's run; dense bundles
    are RTN-quantized to INT4 for it (the reference then is that of the packed weight).
    """
    t = bundle.tensors
    notes: list[str] = []
    x16 = t["x"].astype(np.float16)
    over = int(np.count_nonzero(np.isfinite(t["x"]) & ~np.isfinite(x16)))
    if over:
        notes.append(f"{over} input values overflow float16 (the kernel's input type)")
    g = int(bundle.meta.get("group_size") or -1)
    if bundle.layout.name in ("dense", "qforensics-fakequant"):
        w_kn = t["weight"].astype(np.float64).T
        g = 128 if g == -1 else g
        if w_kn.shape[0] % g:
            g = w_kn.shape[0]
        qw, qz, sc = awq.quantize_rtn(w_kn, g)
        out = {"x": x16, "qweight": qw, "qzeros": qz, "scales": sc}
        ref = x16.astype(np.float64) @ awq.dequantize(qw, qz, sc, g)
        notes.append(f"dense weight RTN-quantized to INT4 group_size={g} to run the project kernel")
        return out, ref, notes
    if bundle.layout.name != "awq-gemm":
        raise ReplayError(f"the project kernel takes the awq-gemm layout, not {bundle.layout.name}")
    g = int(bundle.meta["K"]) if g == -1 else g
    out = {"x": x16, "qweight": t["qweight"], "qzeros": t["qzeros"], "scales": t["scales"].astype(np.float16)}
    if "g_idx" in t:
        out["g_idx"] = t["g_idx"]
    try:
        ref = x16.astype(np.float64) @ awq.dequantize(out["qweight"], out["qzeros"], out["scales"], g, out.get("g_idx"))
    except ReplayError as exc:
        ref = None
        notes.append(f"no CPU reference: {exc}")
    return out, ref, notes
