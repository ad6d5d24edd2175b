"""Small device-side pieces beside the stats op: the dtype codes of the trace, the non-finite row
flags an engine records (vLLM's logits rows), and the logits summary of a step's last row.
Nothing here moves a whole activation to the host."""

from __future__ import annotations

import numpy as np
import torch

from qforensics.hooks import fused
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
