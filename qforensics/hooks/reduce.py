"""Device-side reductions: many same-shaped tensors -> one small float32 vector, computed on the
tensors' own device in a few batched ops (sum, sum of squares, per-channel and per-token min/max),
and the logits summary. Nothing here moves a whole activation to the host."""

from __future__ import annotations

import numpy as np
import torch

from qforensics.trace import schema

_DTYPE_CODE = {
    torch.float32: schema.DTYPE_CODES["float32"],
    torch.float16: schema.DTYPE_CODES["float16"],
    torch.bfloat16: schema.DTYPE_CODES["bfloat16"],
    torch.float64: schema.DTYPE_CODES["float64"],
    torch.float8_e4m3fn: schema.DTYPE_CODES["float8_e4m3fn"],
    torch.float8_e5m2: schema.DTYPE_CODES["float8_e5m2"],
    torch.bool: schema.DTYPE_CODES["bool"],
}


def dtype_code(dt: torch.dtype) -> int:
    code = _DTYPE_CODE.get(dt)
    if code is not None:
        return code
    if not dt.is_floating_point and not dt.is_complex:
        return schema.DTYPE_CODES["int"]
    return schema.DTYPE_CODES["other"]

def fast_group(ts: list[torch.Tensor], rows: int, chans: int, keep_ch: bool) -> torch.Tensor:
    """g same-shaped tensors -> one float32 vector: sum (g), sum of squares (g), then per-channel
    min (g*C) and max (g*C) when kept, else the tensor min (g) and max (g), then per-token absmax
    (g*R). NaN/Inf propagate. The host derives min/max/absmax/mean/std from these.

    Only plain reductions (sum, amin, amax): on CPU builds var_mean, aminmax and vector_norm are
    3-4x slower for these shapes. Single-token tensors (decoding) skip the per-channel pass: their
    channel ranges are the values themselves."""
    with torch.no_grad():
        x = torch.stack(ts) if len(ts) > 1 else ts[0].unsqueeze(0)
        g = x.shape[0]
        if x.dtype not in (torch.float32, torch.float64):
            x = x.to(torch.float32)
        if rows == 1:
            x2 = x.reshape(g, chans)
            parts = [x2.sum(1), (x2 * x2).sum(1), x2.amin(1), x2.amax(1)]
            if keep_ch:
                parts.append(x2.reshape(-1))
        else:
            x = x.reshape(g, rows, chans)
            cmin, cmax = x.amin(1), x.amax(1)
            tok = torch.maximum(x.amax(2), -x.amin(2))
            parts = [x.sum((1, 2)), (x * x).sum((1, 2))]
            parts += ([cmin.reshape(-1), cmax.reshape(-1)] if keep_ch
                      else [cmin.amin(1), cmax.amax(1)])
            parts.append(tok.reshape(-1))
        out = torch.cat(parts)
        return out if out.dtype == torch.float32 else out.to(torch.float32)


def exact_group(ts: list[torch.Tensor], rows: int, chans: int, keep_ch: bool) -> torch.Tensor:
    """Like fast_group but over finite values only, plus NaN and Inf counts:
    [min, max, mean, std, absmax, nan, inf] x g, chan min, chan max (kept), token absmax."""
    with torch.no_grad():
        x = torch.stack(ts) if len(ts) > 1 else ts[0].unsqueeze(0)
        g = x.shape[0]
        x = x.reshape(g, rows, chans).to(torch.float64)
        fin = torch.isfinite(x)
        nan = torch.isnan(x).sum((1, 2))
        inf = (~fin).sum((1, 2)) - nan
        xz = torch.where(fin, x, 0.0)
        cnt = fin.sum((1, 2)).clamp_min(1)
        mean = xz.sum((1, 2)) / cnt
        dev = torch.where(fin, x - mean.view(g, 1, 1), 0.0)
        std = ((dev * dev).sum((1, 2)) / cnt).sqrt()
        big = torch.finfo(torch.float64).max
        cmin = torch.where(fin, x, big).amin(1)
        cmax = torch.where(fin, x, -big).amax(1)
        empty = ~fin.any(1)
        cmin = torch.where(empty, float("nan"), cmin)
        cmax = torch.where(empty, float("nan"), cmax)
        vmin = torch.where(fin, x, big).amin((1, 2))
        vmax = torch.where(fin, x, -big).amax((1, 2))
        absmax = torch.maximum(vmin.abs(), vmax.abs())
        tok = xz.abs().amax(2)
        parts = [torch.stack([vmin, vmax, mean, std, absmax, nan.double(), inf.double()]
                             ).reshape(-1)]
        if keep_ch:
            parts += [cmin.reshape(-1), cmax.reshape(-1)]
        parts.append(tok.reshape(-1))
        return torch.cat(parts)


def fast_logits(logits: torch.Tensor) -> torch.Tensor:
    """15 float32: min max mean var entropy, top-5 values, top-5 ids (last position of batch
    row 0). NaN/Inf propagate; logits_row redoes it exactly when they do."""
    with torch.no_grad():
        v = last_logits(logits).to(torch.float32)
        mn, mx = v.amin(), v.amax()
        mean = v.mean()
        var = (v * v).mean() - mean * mean
        logp = torch.log_softmax(v, 0)
        ent = -(logp.exp() * logp).sum()
        top = torch.topk(v, min(5, v.numel()))
        vals = torch.full((5,), float("nan"), device=v.device)
        ids = torch.full((5,), -1.0, device=v.device)
        vals[:top.values.numel()] = top.values
        ids[:top.indices.numel()] = top.indices.float()
        return torch.cat([torch.stack([mn, mx, mean, var, ent]), vals, ids])


def last_logits(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() == 3:
        return logits[0, -1]
    if logits.dim() > 1:
        return logits.reshape(-1, logits.shape[-1])[-1]
    return logits.reshape(-1)


def logits_row(fast: np.ndarray, logits: torch.Tensor) -> np.ndarray:
    """The 18-number logits row (min max mean std entropy nan inf argmax, top-5 ids, top-5
    values); from the fast pass when everything was finite, else from the exact pass."""
    f = fast.astype(np.float64)
    if np.isfinite(f[:5]).all():
        return np.concatenate([[f[0], f[1], f[2], np.sqrt(max(f[3], 0.0)), f[4], 0, 0, f[10]],
                               f[10:15], f[5:10]])
    return exact_logits(logits).cpu().numpy().astype(np.float64)


def exact_logits(logits: torch.Tensor) -> torch.Tensor:
    """18 numbers: min max mean std entropy nan inf argmax top5 ids (5) top5 values (5)."""
    with torch.no_grad():
        v = last_logits(logits).to(torch.float32)
        fin = torch.isfinite(v)
        nan = torch.isnan(v).sum()
        inf = (~fin).sum() - nan
        vz = torch.where(fin, v, float("-inf"))
        big = torch.finfo(torch.float32).max
        vmin = torch.where(fin, v, big).min()
        vmax = torch.where(fin, v, -big).max()
        cnt = fin.sum().clamp_min(1)
        mean = torch.where(fin, v, 0.0).sum() / cnt
        std = (torch.where(fin, v - mean, 0.0).pow(2).sum() / cnt).sqrt()
        logp = torch.log_softmax(vz, 0)
        ent = -(torch.where(fin, logp.exp() * logp, 0.0)).sum()
        k = min(5, v.numel())
        # topk over NaN-free values; a NaN logit ranks first in plain topk
        top = torch.topk(torch.where(torch.isnan(v), float("-inf"), v), k)
        ids = torch.full((5,), -1.0, dtype=torch.float32, device=v.device)
        vals = torch.full((5,), float("nan"), dtype=torch.float32, device=v.device)
        ids[:k] = top.indices.float()
        vals[:k] = top.values
        arg = torch.where(nan > 0, torch.tensor(-1.0, device=v.device),
                          top.indices[0].float())
        return torch.cat([torch.stack([vmin, vmax, mean, std, ent, nan.float(), inf.float(),
                                       arg]), ids, vals])
