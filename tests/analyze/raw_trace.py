"""Expectations derived straight from a trace file with h5py and numpy, sharing no code with
qforensics: the analyzer's findings are checked against these, not against numbers copied from
its own earlier output."""

from __future__ import annotations

import h5py
import numpy as np


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _records(f: h5py.File) -> dict[str, np.ndarray]:
    return {k: f[f"records/{k}"][:] for k in f["records"].keys()}


def first_nonfinite_output(path) -> tuple[int, int, str]:
    """(step, call_index, module name) of the first call, in call order, whose inputs are all
    finite and whose output holds NaN/Inf."""
    with h5py.File(path, "r") as f:
        r = _records(f)
        names = [_text(v) for v in f["modules/name"][:]]
    bad = (r["nan_count"] + r["inf_count"]) > 0
    for i in np.argsort(r["call_index"], kind="stable"):
        if not bad[i] or r["io"][i] != 1:
            continue
        same = (r["call_index"] == r["call_index"][i]) & (r["io"] == 0)
        if not bad[same].any():
            return int(r["step"][i]), int(r["call_index"][i]), names[int(r["module_id"][i])]
    raise AssertionError(f"{path}: no call turns finite input into non-finite output")


def input_absmax(path, module: str, step: int) -> np.ndarray:
    """Per-channel absmax of `module`'s first input (slot 0) at `step`, from /channels."""
    with h5py.File(path, "r") as f:
        r = _records(f)
        names = [_text(v) for v in f["modules/name"][:]]
        mid = names.index(module)
        hit = np.nonzero((r["module_id"] == mid) & (r["step"] == step) & (r["io"] == 0)
                         & (r["slot"] == 0))[0]
        i = hit[np.argmin(r["call_index"][hit])]
        off, n = int(r["chan_offset"][i]), int(r["channels"][i])
        lo = f["channels/min"][off:off + n].astype(np.float64)
        hi = f["channels/max"][off:off + n].astype(np.float64)
    return np.fmax(np.abs(lo), np.abs(hi))


def most_persistent_dim(path, step: int, ratio: float, min_modules: int) -> int:
    """The hidden dim whose absmax reaches `ratio` x its module's median channel absmax in the
    most linear/block inputs of one width at `step` (ties: the larger ratio)."""
    with h5py.File(path, "r") as f:
        r = _records(f)
        kinds = [_text(v) for v in f["modules/kind"][:]]
        sel = np.nonzero((r["step"] == step) & (r["io"] == 0) & (r["slot"] == 0)
                         & (r["chan_offset"] >= 0))[0]
        seen: set[int] = set()
        by_width: dict[int, list[np.ndarray]] = {}
        for i in sel[np.argsort(r["call_index"][sel], kind="stable")]:
            m = int(r["module_id"][i])
            if m in seen or kinds[m] not in ("linear", "quantized_linear", "block"):
                continue
            seen.add(m)
            off, n = int(r["chan_offset"][i]), int(r["channels"][i])
            a = np.fmax(np.abs(f["channels/min"][off:off + n].astype(np.float64)),
                        np.abs(f["channels/max"][off:off + n].astype(np.float64)))
            by_width.setdefault(n, []).append(np.where(np.isfinite(a), a, 0.0))
    best = (-1, -1.0, -1)
    for rows in by_width.values():
        if len(rows) < min_modules:
            continue
        a = np.stack(rows)
        rat = a / np.maximum(np.median(a, axis=1, keepdims=True), 1e-30)
        count = (rat >= ratio).sum(axis=0)
        for d in np.nonzero(count >= min_modules)[0]:
            key = (int(count[d]), float(rat[:, d].max()), int(d))
            if key[:2] > best[:2]:
                best = key
    assert best[2] >= 0, "no persistent dim"
    return best[2]
