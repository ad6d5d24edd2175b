"""Host-side assembly: the reduced vectors that came back from the device -> record rows, channel
and token arrays, and one StepBatch per step for the writer. Numpy only; the one device call left
here is the exact (finite-only) pass of a failing step, which goes through reduce.exact_group."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from qforensics.formats import FP16_MAX
from qforensics.hooks.reduce import dtype_code, exact_group
from qforensics.trace import schema
from qforensics.trace.writer import StepBatch

_DESCRIBED: dict[Any, tuple[int, int, int, int]] = {}


def describe(desc: list[tuple[Any, torch.dtype, torch.device]]
             ) -> tuple[np.ndarray, ...] | None:
    """(channels, numel, dtype code, flags) of tensors from their (shape, dtype, device)."""
    cache = _DESCRIBED
    rows = []
    for d in desc:
        r = cache.get(d)
        if r is None:
            shape, dtype, device = d
            chans = int(shape[-1]) if len(shape) else 1
            numel = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
            flags = (schema.FLAG_META if device.type == "meta" else 0) | (
                0 if dtype.is_floating_point else schema.FLAG_NONFLOAT)
            r = cache[d] = (chans, numel, dtype_code(dtype), flags)
            if len(cache) > 4096:
                cache.clear()
        rows.append(r)
    if not rows:
        return None
    arr = np.array(rows, np.int64)
    return arr[:, 0].copy(), arr[:, 1].copy(), arr[:, 2].astype(np.int8), arr[:, 3].astype(
        np.int8)


class UniqueStats:
    """Host-side stats of the unique tensors of one reduction, filled group by group."""

    def __init__(self, n_u: int, need: np.ndarray) -> None:
        self.need = need
        self.sc = np.full((n_u, 5), np.nan)  # min max mean std absmax
        self.nan = np.zeros(n_u, np.int64)
        self.inf = np.zeros(n_u, np.int64)
        self.rows = np.zeros(n_u, np.int64)
        self.chans = np.zeros(n_u, np.int64)
        self.numel = np.zeros(n_u, np.int64)
        self.computed = np.zeros(n_u, bool)
        self.dtype_code = np.zeros(n_u, np.int8)
        self.flags = np.zeros(n_u, np.int8)
        self.chan_off = np.full(n_u, -1, np.int64)
        self.tok_off = np.full(n_u, -1, np.int64)
        self.tok_cnt = np.zeros(n_u, np.int64)
        self._cmin: list[np.ndarray] = []
        self._cmax: list[np.ndarray] = []
        self._tok: list[np.ndarray] = []
        self._chan_len = 0
        self._tok_len = 0

    def describe_all(self, desc: list[tuple[Any, torch.dtype, torch.device]]) -> None:
        """Shape facts of every unique tensor from its (shape, dtype, device)."""
        self.set_described(describe(desc))

    def set_described(self, d: tuple[np.ndarray, ...] | None) -> None:
        """Shape facts from `describe` (a step plan keeps them from step to step)."""
        if d is not None:
            self.chans[:], self.numel[:], self.dtype_code[:], self.flags[:] = d

    def unpack(self, plan: list, host: dict, cursor: dict) -> None:
        """Fast-pass results (layout of reduce.fast_group) into the arrays."""
        for idx, rows, chans, keep, dev, size in plan:
            c = cursor[dev]
            flat = host[dev][c:c + size]  # float32: channel and token values stay float32
            cursor[dev] = c + size
            g = len(idx)
            n_el = float(rows * chans)
            mean = flat[:g].astype(np.float64) / n_el
            with np.errstate(invalid="ignore", over="ignore"):
                var = np.maximum(flat[g:2 * g].astype(np.float64) / n_el - mean * mean, 0.0)
            off = 2 * g
            with np.errstate(invalid="ignore"):
                if rows == 1:  # see reduce.fast_group: min, max, then the values when kept
                    vmin = flat[off:off + g].astype(np.float64)
                    vmax = flat[off + g:off + 2 * g].astype(np.float64)
                    off += 2 * g
                    absmax = np.maximum(np.abs(vmin), np.abs(vmax))
                    if keep:
                        vals = flat[off:off + g * chans].reshape(g, chans)
                        sel = self.need[idx]
                        if sel.any():
                            m = int(sel.sum())
                            self.chan_off[idx[sel]] = self._chan_len + np.arange(m) * chans
                            # one token: min and max of a channel are its value (one array
                            # for both, read-only from here on)
                            kept = vals.reshape(-1) if m == g else vals[sel].reshape(-1)
                            self._cmin.append(kept)
                            self._cmax.append(kept)
                            self._chan_len += m * chans
                    self.sc[idx] = np.stack([vmin, vmax, mean, np.sqrt(var), absmax], axis=1)
                    self.rows[idx] = 1
                    self.computed[idx] = True
                    self.tok_off[idx] = self._tok_len + np.arange(g)
                    self.tok_cnt[idx] = 1
                    self._tok.append(absmax.astype(np.float32))
                    self._tok_len += g
                    continue
                if keep:
                    cmin = flat[off:off + g * chans].reshape(g, chans)
                    cmax = flat[off + g * chans:off + 2 * g * chans].reshape(g, chans)
                    off += 2 * g * chans
                    vmin = cmin.min(axis=1).astype(np.float64)
                    vmax = cmax.max(axis=1).astype(np.float64)
                    sel = self.need[idx]
                    if sel.any():
                        m = int(sel.sum())
                        self.chan_off[idx[sel]] = self._chan_len + np.arange(m) * chans
                        every = m == g  # then views, not copies
                        self._cmin.append((cmin if every else cmin[sel]).reshape(-1))
                        self._cmax.append((cmax if every else cmax[sel]).reshape(-1))
                        self._chan_len += m * chans
                else:
                    vmin = flat[off:off + g].astype(np.float64)
                    vmax = flat[off + g:off + 2 * g].astype(np.float64)
                    off += 2 * g
                self.sc[idx] = np.stack([vmin, vmax, mean, np.sqrt(var),
                                         np.maximum(np.abs(vmin), np.abs(vmax))], axis=1)
            self.rows[idx] = rows
            self.computed[idx] = True
            self.tok_off[idx] = self._tok_len + np.arange(g) * rows
            self.tok_cnt[idx] = rows
            self._tok.append(flat[off:off + g * rows])
            self._tok_len += g * rows

    def exact_pass(self, bad: np.ndarray, order: list[torch.Tensor], want_channels: bool,
                   chan_limit: int) -> None:
        """Finite-only stats and exact NaN/Inf counts for the tensors the fast pass flagged;
        overwrites their scalars, channel ranges and token maxima (one more transfer)."""
        groups: dict[Any, list[int]] = {}
        lost = [int(j) for j in bad if order[int(j)] is None]
        if lost:  # modified in place before the exact pass could see it: counts unknown
            self.nan[lost] = 1
            self.flags[lost] |= schema.FLAG_DEGRADED
            bad = np.array([j for j in bad if order[int(j)] is not None], np.int64)
            if not len(bad):
                return
        for j in bad:
            t = order[int(j)]
            groups.setdefault((t.shape, t.dtype, t.device), []).append(int(j))
        plan = []
        per_dev: dict[torch.device, list[torch.Tensor]] = {}
        for _, idx in groups.items():
            t0 = order[idx[0]]
            chans = int(t0.shape[-1]) if t0.dim() else 1
            rows = t0.numel() // max(chans, 1)
            keep = want_channels and chans <= chan_limit
            packed = exact_group([order[j] for j in idx], rows, chans, keep)
            per_dev.setdefault(packed.device, []).append(packed)
            plan.append((np.array(idx), rows, chans, keep, packed.device, packed.numel()))
        host = {dev: torch.cat(parts).cpu().numpy() for dev, parts in per_dev.items()}
        cursor = {dev: 0 for dev in host}
        cmin_all = self.cmin().copy()  # written below: never a view of another array
        cmax_all = self.cmax().copy()
        tok_all = self.tok().copy()
        for idx, rows, chans, keep, dev, size in plan:
            c = cursor[dev]
            flat = host[dev][c:c + size]
            cursor[dev] = c + size
            g = len(idx)
            sc = flat[:7 * g].reshape(7, g)
            off = 7 * g
            self.sc[idx] = sc[:5].T
            self.nan[idx] = sc[5]
            self.inf[idx] = sc[6]
            if keep:
                cmin = flat[off:off + g * chans].reshape(g, chans)
                cmax = flat[off + g * chans:off + 2 * g * chans].reshape(g, chans)
                off += 2 * g * chans
                for k, j in enumerate(idx):
                    o = self.chan_off[j]
                    if o >= 0:
                        cmin_all[o:o + chans] = cmin[k]
                        cmax_all[o:o + chans] = cmax[k]
            tok = flat[off:off + g * rows].reshape(g, rows)
            for k, j in enumerate(idx):
                o = self.tok_off[j]
                tok_all[o:o + rows] = tok[k]
        self._cmin, self._cmax, self._tok = [cmin_all], [cmax_all], [tok_all]
        # finite-only min/max of a tensor with no finite value: NaN (not +-max)
        big = np.finfo(np.float64).max
        empty = self.sc[bad, 0] >= big
        self.sc[bad[empty]] = np.nan

    def cmin(self) -> np.ndarray:
        return _joined(self._cmin, np.float64)

    def cmax(self) -> np.ndarray:
        return _joined(self._cmax, np.float64)

    def channel_blocks(self) -> tuple[np.ndarray, np.ndarray]:
        """(min, max) channel arrays; one array for both when every part is shared (decode
        steps: a token's channel min and max are the same values). Read-only."""
        lo = self.cmin()
        same = len(self._cmin) == len(self._cmax) and all(
            a is b for a, b in zip(self._cmin, self._cmax))
        return lo, (lo if same else self.cmax())

    def tok(self) -> np.ndarray:
        return _joined(self._tok, np.float32)


def _joined(parts: list[np.ndarray], empty: Any) -> np.ndarray:
    """The parts as one array (the part itself when there is one: treat as read-only)."""
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros(0, empty)


def assemble_records(step: int, track_versions: bool, meta_arr: np.ndarray, tensors: list,
                     versions: list, which: np.ndarray, st: UniqueStats, chan_io: str,
                     template: np.ndarray | None = None) -> dict[str, Any]:
    """One reduction's records (in pending order) with offsets into its own channel and token
    arrays. `template`: an earlier step's records of the same plan (hooks/planunpack.py),
    whose layout columns (module, io, slot, dtype, sizes, offsets) this step shares; only the
    call indices, flags and statistics are written then."""
    n = len(meta_arr)
    if template is not None and len(template) == n:
        rec = template.copy()
    else:
        rec = np.zeros(n, dtype=schema.record_dtype())
        rec["module_id"] = meta_arr[:, 1]
        rec["io"] = meta_arr[:, 2]
        rec["slot"] = meta_arr[:, 3]
        rec["dtype"] = st.dtype_code[which]
        rec["numel"] = st.numel[which]
        rec["rows"] = st.rows[which]
        rec["channels"] = st.chans[which]
        coff = st.chan_off[which]
        if chan_io == "inputs":
            coff = np.where(meta_arr[:, 2] == schema.IO_INPUT, coff, -1)
        rec["chan_offset"] = coff
        rec["tok_offset"] = st.tok_off[which]
        rec["tok_count"] = st.tok_cnt[which]
    rec["call_index"] = meta_arr[:, 0]
    rec["step"] = step
    flags = st.flags[which].copy()
    if track_versions:
        now = np.fromiter((t._version for t in tensors), np.int64, n)
        flags |= np.where(now != np.asarray(versions, np.int64), schema.FLAG_MUTATED, 0)
    rec["flags"] = flags
    sc = st.sc[which]
    for k, f in enumerate(("min", "max", "mean", "std", "absmax")):
        rec[f] = sc[:, k]
    rec["nan_count"] = st.nan[which]
    rec["inf_count"] = st.inf[which]
    cmin, cmax = st.channel_blocks()
    return {"records": rec, "cmin": cmin, "cmax": cmax, "tok": st.tok()}


def build_batch(parts: list[dict[str, Any]], *, step: int, t0: float,
                t_end: float | None = None, first_call: int,
                next_call: int, logits_row: np.ndarray | None, ids: np.ndarray, complete: bool,
                snaps: np.ndarray, data: np.ndarray, incidents: np.ndarray,
                channel_dtype: str, detail: bool = True) -> StepBatch:
    """The step's parts (one per reduction) -> one StepBatch: records in call order, offsets
    rebased, the step row with its logits summary. `t_end`: when the step ended, for a step
    emitted later (default: now). `detail` False: a compiled step whose ring detail was
    spilled (hooks/graphlate.py), `complete` 2."""
    recs = []
    cmins, cmaxs, toks = [], [], []
    chan_base = tok_base = 0
    for part in parts:
        rec = part["records"]
        rec["chan_offset"] = np.where(rec["chan_offset"] >= 0, rec["chan_offset"] + chan_base, -1)
        rec["tok_offset"] = np.where(rec["tok_offset"] >= 0, rec["tok_offset"] + tok_base, -1)
        chan_base += len(part["cmin"])
        tok_base += len(part["tok"])
        recs.append(rec)
        cmins.append(part["cmin"])
        cmaxs.append(part["cmax"])
        toks.append(part["tok"])
    rec = _joined(recs, schema.record_dtype())
    ci = rec["call_index"]
    if len(ci) > 1 and not (ci[1:] >= ci[:-1]).all():
        rec = rec[np.argsort(ci, kind="stable")]
    st = np.zeros(1, dtype=schema.step_dtype())
    s = st[0]
    s["step"] = step
    s["t_start"] = t0
    s["duration"] = (time.time() if t_end is None else t_end) - t0
    s["complete"] = (schema.STEP_WHOLE if detail else schema.STEP_SPILLED) if complete else (
        schema.STEP_RAISED)
    s["record_offset"] = 0
    s["record_count"] = len(rec)
    s["first_call"] = first_call if next_call > first_call else -1
    s["n_calls"] = next_call - first_call
    bad = (rec["nan_count"] + rec["inf_count"]) > 0
    s["n_nonfinite_records"] = int(bad.sum())
    s["first_nonfinite_record"] = int(np.argmax(bad)) if bad.any() else -1
    out_bad = bad & (rec["io"] == schema.IO_OUTPUT)
    s["first_nonfinite_call"] = int(rec["call_index"][np.argmax(out_bad)]) if out_bad.any() else -1
    s["token_offset"] = 0
    s["token_count"] = len(ids)
    if logits_row is not None:
        s["has_logits"] = 1
        if not logits_row[0] <= logits_row[1]:  # no finite logit at all
            logits_row = logits_row.copy()
            logits_row[[0, 1, 2, 3, 4]] = np.nan
        (s["logits_min"], s["logits_max"], s["logits_mean"], s["logits_std"],
         s["logits_entropy"]) = logits_row[:5]
        s["logits_nan"], s["logits_inf"], s["logits_argmax"] = (
            int(logits_row[5]), int(logits_row[6]), int(logits_row[7]))
        s["logits_top5_ids"] = logits_row[8:13].astype(np.int64)
        s["logits_top5_values"] = logits_row[13:18]
    else:
        s["logits_argmax"] = -1
        s["logits_top5_ids"] = -1
        for f in ("logits_min", "logits_max", "logits_mean", "logits_std", "logits_entropy"):
            s[f] = np.nan
        s["logits_top5_values"] = np.nan
    chan_min = _joined(cmins, np.float64)
    same = len(cmins) == len(cmaxs) and all(a is b for a, b in zip(cmins, cmaxs))
    batch = StepBatch(
        steps=st, records=rec,
        chan_min=chan_min, chan_max=chan_min if same else _joined(cmaxs, np.float64),
        tok_absmax=_joined(toks, np.float32),
        input_ids=ids, snapshots=snaps, snapshot_bytes=data, incidents=incidents,
    )
    if channel_dtype == "float16":
        batch.chan_min = to_f16(batch.chan_min)
        batch.chan_max = to_f16(batch.chan_max)
    return batch


def to_f16(a: np.ndarray) -> np.ndarray:
    """float16 without turning large finite values into inf (clip finite values to 65504)."""
    lim = np.float64(FP16_MAX)
    a = np.asarray(a, np.float64)
    return np.where(np.isfinite(a), np.clip(a, -lim, lim), a).astype(np.float16)
