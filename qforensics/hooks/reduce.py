"""Device-side reductions: many same-shaped tensors -> one small float32 vector, computed on the
tensors' own device in a few batched ops (sum, sum of squares, per-channel and per-token min/max),
and the logits summary. Nothing here moves a whole activation to the host."""

from __future__ import annotations

import numpy as np
import torch

from qforensics.hooks import fused
from qforensics.trace import schema

# Largest working set (elements) of one chunk of a reduction over a big activation: with its
# float32 copy and masks, about 4 bytes x 4 x this on the device (64 MiB at the default).
REDUCE_CHUNK_ELEMS = 1 << 22

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
    """g same-shaped tensors -> one float32 vector (the layout of fast_stacked)."""
    return fast_stacked(torch.stack(ts) if len(ts) > 1 else ts[0].unsqueeze(0), rows, chans,
                        keep_ch)


def fast_stacked(x: torch.Tensor, rows: int, chans: int, keep_ch: bool) -> torch.Tensor:
    """The vector of fast_parts in one tensor."""
    parts = fast_parts(x, rows, chans, keep_ch)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def fast_parts(x: torch.Tensor, rows: int, chans: int, keep_ch: bool,
               out: torch.Tensor | None = None) -> list[torch.Tensor]:
    """g tensors stacked on dim 0 -> float32 vectors to concatenate: sum (g), sum of squares (g), then
    per-channel min (g*C) and max (g*C) when kept, else the tensor min (g) and max (g), then
    per-token absmax (g*R). NaN/Inf propagate. The host derives min/max/absmax/mean/std from
    these.

    Only plain reductions (sum, amin, amax): on CPU builds var_mean and aminmax are 3-4x slower
    for these shapes; the 2-norm is faster than (x * x).sum but less accurate, which the
    variance the host derives (sumsq / n - mean^2) cannot afford. Single-token tensors
    (decoding) skip the per-channel pass: their channel ranges are the values themselves, and their per-token absmax is max(|min|, |max|),
    which the host derives: [sum, sumsq, min, max] (g each), then the values (g*C) when kept."""
    if out is not None:  # the vector written into `out` (a plan's step buffer)
        if x.device.type == "cpu":
            got = fused.REDUCER.parts(x, rows, chans, keep_ch, out)
            if got is not None:
                return got
        torch.cat(fast_parts(x, rows, chans, keep_ch), out=out)
        return [out]
    if x.device.type == "cpu":
        got = fused.REDUCER.parts(x, rows, chans, keep_ch)
        if got is not None:
            return got
    with torch.no_grad():
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
            tmax, tmin = x.amax(2), x.amin(2)  # per token
            tok = torch.maximum(tmax, -tmin)
            parts = [x.sum((1, 2)), (x * x).sum((1, 2))]
            # the tensor's min and max: from the per-channel ranges when they are kept (the
            # host takes them), else from the per-token ones (no per-channel pass at all)
            parts += ([x.amin(1).reshape(-1), x.amax(1).reshape(-1)] if keep_ch
                      else [tmin.amin(1), tmax.amax(1)])
            parts.append(tok.reshape(-1))
        if x.dtype != torch.float32:
            parts = [p.to(torch.float32) for p in parts]
        return parts


def _row_chunks(rows: int, chans: int):
    """Row ranges whose float32 working set stays under REDUCE_CHUNK_ELEMS elements."""
    step = max(1, REDUCE_CHUNK_ELEMS // max(chans, 1))
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


def fast_one(t: torch.Tensor, rows: int, chans: int, keep_ch: bool) -> torch.Tensor:
    """fast_group's layout for a single tensor, reduced in row chunks so that no float32 copy
    larger than REDUCE_CHUNK_ELEMS elements exists at once (long prefills, wide layers)."""
    if rows * chans <= REDUCE_CHUNK_ELEMS or rows == 1:
        return fast_group([t], rows, chans, keep_ch)
    with torch.no_grad():
        x = t.reshape(rows, chans)
        s = q = cmin = cmax = None
        toks = []
        for r0, r1 in _row_chunks(rows, chans):
            c = x[r0:r1]
            if c.dtype not in (torch.float32, torch.float64):
                c = c.to(torch.float32)
            cs, cq = c.sum(), (c * c).sum()
            lo, hi = c.amin(0), c.amax(0)
            toks.append(torch.maximum(c.amax(1), -c.amin(1)))
            if s is None:
                s, q, cmin, cmax = cs, cq, lo, hi
            else:
                s, q = s + cs, q + cq
                cmin, cmax = torch.minimum(cmin, lo), torch.maximum(cmax, hi)
        assert s is not None and q is not None and cmin is not None and cmax is not None
        parts = [s.reshape(1), q.reshape(1)]
        parts += [cmin, cmax] if keep_ch else [cmin.amin().reshape(1), cmax.amax().reshape(1)]
        parts.append(torch.cat(toks))
        out = torch.cat(parts)
        return out if out.dtype == torch.float32 else out.to(torch.float32)


def exact_group(ts: list[torch.Tensor], rows: int, chans: int, keep_ch: bool) -> torch.Tensor:
    """Like fast_group but over finite values only, plus NaN and Inf counts:
    [min, max, mean, std, absmax, nan, inf] x g, chan min, chan max (kept), token absmax.

    Works tensor by tensor in row chunks, in float32 (float64 inputs stay float64): the working
    set is bounded by REDUCE_CHUNK_ELEMS elements whatever the activation's size, and no float64
    copy of an activation is made. Only the small per-chunk partials are accumulated in
    float64."""
    heads: list[torch.Tensor] = []
    chan_parts: list[torch.Tensor] = []
    tok_parts: list[torch.Tensor] = []
    with torch.no_grad():
        for t in ts:
            x = t.reshape(rows, chans)
            dev = x.device
            acc = torch.zeros(4, dtype=torch.float64, device=dev)  # nan, inf, count, sum
            sq = torch.zeros((), dtype=torch.float64, device=dev)
            cmin = cmax = None
            vmin = vmax = None
            toks = []
            for r0, r1 in _row_chunks(rows, chans):
                c = x[r0:r1]
                if c.dtype not in (torch.float32, torch.float64):
                    c = c.to(torch.float32)
                big = torch.finfo(c.dtype).max
                fin = torch.isfinite(c)
                n_nan = torch.isnan(c).sum()
                n_fin = fin.sum()
                cz = torch.where(fin, c, 0.0)
                acc += torch.stack([n_nan, c.numel() - n_fin - n_nan, n_fin, cz.sum()]).double()
                sq = sq + (cz * cz).sum().double()
                lo = torch.where(fin, c, big).amin(0)
                hi = torch.where(fin, c, -big).amax(0)
                cmin = lo if cmin is None else torch.minimum(cmin, lo)
                cmax = hi if cmax is None else torch.maximum(cmax, hi)
                # a row holding NaN (Inf) reads NaN (Inf): which token rows went bad
                toks.append(c.abs().amax(1))
            assert cmin is not None and cmax is not None
            lim = torch.finfo(cmin.dtype).max
            empty_ch = (cmin >= lim) & (cmax <= -lim)  # no finite value in this channel
            vmin, vmax = cmin.amin().double(), cmax.amax().double()
            cnt = acc[2].clamp_min(1)
            mean = acc[3] / cnt
            std = (sq / cnt - mean * mean).clamp_min(0).sqrt()
            absmax = torch.maximum(vmin.abs(), vmax.abs())
            head = torch.stack([vmin, vmax, mean, std, absmax])
            head = torch.where(acc[2] > 0, head, float("nan"))  # no finite value at all
            heads.append(torch.cat([head, acc[:2]]))
            if keep_ch:
                chan_parts.append(torch.stack([
                    torch.where(empty_ch, float("nan"), cmin),
                    torch.where(empty_ch, float("nan"), cmax)]).double())
            tok_parts.append(torch.cat(toks).double())
        g = len(ts)
        parts = [torch.stack(heads, 1).reshape(-1)]  # 7 x g, field-major like before
        if keep_ch:
            ch = torch.stack(chan_parts)  # g x 2 x C
            parts += [ch[:, 0].reshape(-1), ch[:, 1].reshape(-1)]
        parts.append(torch.stack(tok_parts).reshape(g * rows))
        return torch.cat(parts)


def nonfinite_rows(t: torch.Tensor) -> torch.Tensor:
    """[rows, 1] float32: 1.0 where a row of t (last dim) holds a NaN or an Inf, else 0.0.

    x * 0 is 0 for every finite x and NaN for NaN and +-Inf, so a row's sum of those is 0 exactly
    when the row is finite (no overflow: it sums zeros). One multiply and one sum, about 10x
    cheaper on CPU than isfinite + all for bf16 logits; on CPU one pass of fused_reduce.c's
    bit test when that is built."""
    done = fused.REDUCER.nonfinite_rows(t)
    if done is not None:
        return done
    with torch.no_grad():
        z = t.reshape(-1, t.shape[-1]).mul(0).sum(-1, keepdim=True)
        return z.ne(0).to(torch.float32)


def fast_logits(logits: torch.Tensor) -> torch.Tensor:
    """15 float32: min max mean var entropy, top-5 values, top-5 ids (last position of batch
    row 0). NaN/Inf propagate; logits_row redoes it exactly when they do."""
    with torch.no_grad():
        row = last_logits(logits)
        done = fused.REDUCER.logits(row)  # one C pass on CPU (hooks/fused.py)
        if done is not None:
            return done
        v = row.to(torch.float32)
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
