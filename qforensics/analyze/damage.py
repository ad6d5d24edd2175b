"""Predicted quantization damage to each linear module's INPUT activations, from the recorded
per-channel ranges of one step: the scale each scheme would use, the channels whose absmax is
below half their scale (every value rounds to zero) and the channels that overflow.

Schemes (symmetric round-to-nearest; qmax 7 for INT4, 127 for INT8):
  int{4,8}-per-tensor   one scale absmax/qmax over the whole input
  int{4,8}-per-token    one scale per token (the activation form of per-channel): a channel is
                        counted when it is below half the SMALLEST token scale, i.e. zero in every
                        token (from the per-token absmax; without it, the peak token's scale)
  int{4,8}-g{32,64,128} one scale per group of consecutive channels (over all tokens)
  fp8-{e4m3,e5m2}       static scale 1: overflow above 448 / 57344, zero below half the
                        smallest subnormal (2^-9 / 2^-16)
  fp8-*-dynamic         per-tensor scale absmax/fmax: nothing overflows
Vectorized over modules x channels (one matrix per input width).
"""

from __future__ import annotations

import numpy as np

from qforensics.analyze.findings import SchemeDamage, UnsafeModules
from qforensics.analyze.outliers import ChannelRow
from qforensics.analyze.thresholds import Thresholds
from qforensics.formats import FORMAT_LIMITS, FP8_MIN_SUBNORMAL, symmetric_qmax

__all__ = ["SCHEMES", "per_tensor_zeroed", "predict_damage", "rank_unsafe"]

QMAX = {b: float(symmetric_qmax(b)) for b in (4, 8)}
GROUPS = (32, 64, 128)
SCHEMES: tuple[str, ...] = tuple(
    [f"int{b}-{g}" for b in (4, 8) for g in ("per-tensor", "per-token")]
    + [f"int{b}-g{g}" for b in (4, 8) for g in GROUPS]
    + ["fp8-e4m3", "fp8-e4m3-dynamic", "fp8-e5m2", "fp8-e5m2-dynamic"]
)


def _scheme_order(s: str) -> int:
    return SCHEMES.index(s) if s in SCHEMES else len(SCHEMES)


def _line(scheme: str, scale: float, scale_min: float, zeroed: int, total: int,
          overflow: int, fallback: bool = False) -> str:
    if scheme.endswith("per-token"):
        head = (f"{scheme} (peak token scale {scale:.4g})" if fallback else
                f"{scheme} smallest token scale {scale_min:.4g} (largest {scale:.4g})")
        tail = "quantize to zero at the peak token" if fallback else \
            "quantize to zero in every token"
    elif "-g" in scheme:
        head = f"{scheme} largest group scale {scale:.4g} (smallest {scale_min:.4g})"
        tail = "quantize to zero"
    else:
        head = f"{scheme} scale {scale:.4g}"
        tail = "quantize to zero"
    text = f"{head}: {zeroed:,} of {total:,} channels have absmax below scale/2 and {tail}"
    if overflow:
        lim = FORMAT_LIMITS["fp8-e5m2" if "e5m2" in scheme else "fp8-e4m3"]
        text += f"; {overflow:,} channels exceed {lim:g} and overflow"
    return text


def per_tensor_zeroed(A: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of a (modules x channels) absmax matrix: the per-tensor INT`bits` scale and the
    channels whose absmax is below half of it (every value rounds to 0)."""
    s = A.max(axis=1) / QMAX[bits]
    return s, (A < s[:, None] / 2).sum(1)


def predict_damage(rows: list[ChannelRow], th: Thresholds) -> list[SchemeDamage]:
    """Every scheme x every module row; one numpy pass per input width and scheme."""
    by_width: dict[int, list[ChannelRow]] = {}
    for r in rows:
        if len(r.absmax):
            by_width.setdefault(len(r.absmax), []).append(r)
    out: list[SchemeDamage] = []
    for grp in by_width.values():
        A = np.stack([r.absmax for r in grp])  # (M, C) float64
        M, C = A.shape
        amax = A.max(axis=1)
        tok_min = np.array([float(np.nanmin(r.tokens)) if r.tokens is not None and len(r.tokens)
                            and np.isfinite(r.tokens).any() else np.nan for r in grp])
        tok_max = np.array([float(np.nanmax(r.tokens)) if r.tokens is not None and len(r.tokens)
                            and np.isfinite(r.tokens).any() else np.nan for r in grp])
        no_tok = ~np.isfinite(tok_min)
        tok_min = np.where(no_tok, amax, tok_min)
        tok_max = np.where(no_tok, amax, tok_max)
        results: list[tuple[str, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        for bits, q in QMAX.items():
            s, zeroed = per_tensor_zeroed(A, bits)
            results.append((f"int{bits}-per-tensor", s, s, zeroed, np.zeros(M, np.int64)))
            smin, smax = tok_min / q, tok_max / q
            results.append((f"int{bits}-per-token", smax, smin, (A < smin[:, None] / 2).sum(1),
                            np.zeros(M, np.int64)))
        for g in GROUPS:
            n_g = -(-C // g)
            P = np.zeros((M, n_g * g))
            P[:, :C] = A
            valid = np.zeros(n_g * g, bool)
            valid[:C] = True
            P3 = P.reshape(M, n_g, g)
            gmax = P3.max(axis=2)  # (M, G)
            for bits, q in QMAX.items():
                s = gmax / q
                z = ((P3 < s[:, :, None] / 2) & valid.reshape(n_g, g)[None]).sum(axis=(1, 2))
                results.append((f"int{bits}-g{g}", s.max(axis=1), s.min(axis=1), z,
                                np.zeros(M, np.int64)))
        for fmt in ("fp8-e4m3", "fp8-e5m2"):
            fmax, sub = FORMAT_LIMITS[fmt], FP8_MIN_SUBNORMAL[fmt]
            ones = np.ones(M)
            results.append((fmt, ones, ones, (A < sub / 2).sum(1), (A > fmax).sum(1)))
            s = amax / fmax
            results.append((f"{fmt}-dynamic", s, s, (A < (s * sub / 2)[:, None]).sum(1),
                            np.zeros(M, np.int64)))
        names = [r.module for r in grp]
        no_tok_l = no_tok.tolist()
        for scheme, scale, smin, zeroed, over in results:
            frac = zeroed / C
            unsafe = ((frac >= th.unsafe_fraction) | (over > 0)).tolist()
            per_token = scheme.endswith("per-token")
            # plain Python numbers first: a numpy scalar per field and module costs ~4x more
            for name, sc, sm, z, o, fr, u, nt in zip(
                    names, np.asarray(scale, np.float64).tolist(),
                    np.asarray(smin, np.float64).tolist(), np.asarray(zeroed).tolist(),
                    np.asarray(over).tolist(), frac.tolist(), unsafe, no_tok_l):
                out.append(SchemeDamage(
                    module=name, scheme=scheme, scale=sc, scale_min=sm,
                    channels_zeroed=int(z), channels_total=C, overflow_count=int(o),
                    fraction=fr, unsafe=u,
                    line=_line(scheme, sc, sm, int(z), C, int(o), nt and per_token)))
    order = {r.module: k for k, r in enumerate(rows)}
    out.sort(key=lambda d: (_scheme_order(d.scheme), order.get(d.module, 0)))
    return out


def rank_unsafe(damage: list[SchemeDamage], th: Thresholds) -> list[UnsafeModules]:
    """Per scheme: the modules that make it unsafe, worst first (overflow, then zeroed share)."""
    by_scheme: dict[str, list[SchemeDamage]] = {}
    for d in damage:
        by_scheme.setdefault(d.scheme, []).append(d)
    out = []
    for scheme in sorted(by_scheme, key=_scheme_order):
        ds = by_scheme[scheme]
        bad = sorted((d for d in ds if d.unsafe),
                     key=lambda d: (-d.overflow_count, -d.fraction, -d.scale))
        if bad:
            w = bad[0]
            what = (f"{w.overflow_count:,} channels overflow" if w.overflow_count else
                    f"{w.channels_zeroed:,} of {w.channels_total:,} channels quantize to zero")
            line = (f"{scheme}: unsafe for {len(bad)} of {len(ds)} modules; worst "
                    f"{w.module} ({what})")
        else:
            line = (f"{scheme}: no module zeroes {th.unsafe_fraction:.0%} of its input channels "
                    f"or overflows ({len(ds)} modules)")
        out.append(UnsafeModules(scheme=scheme, modules=bad[:int(th.top)], n_unsafe=len(bad),
                                 n_modules=len(ds), line=line))
    return out
