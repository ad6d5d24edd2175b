"""Quality metrics of a quantized model against its unquantized reference (pure torch).

All take logits ``[positions, vocab]`` (or ``[1, positions, vocab]``) and are NaN-aware: a
position whose logits are not finite counts as a disagreement, and makes KL and perplexity NaN
(a model that emits NaN has no perplexity; `recovered_fraction` then says 0).
"""

from __future__ import annotations

import math

import torch

__all__ = ["mean_kl", "perplexity", "recovered_fraction", "top1_agreement"]


def _2d(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() == 3:
        if logits.shape[0] != 1:
            raise ValueError("batched logits: pass one sequence ([positions, vocab])")
        logits = logits[0]
    if logits.dim() != 2:
        raise ValueError(f"logits must be [positions, vocab], got shape {tuple(logits.shape)}")
    return logits


def top1_agreement(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Fraction of positions whose argmax equals ``targets`` (token ids, [positions]).

    Rows with any non-finite logit never agree. NaN when there are no positions."""
    logits = _2d(logits)
    targets = targets.reshape(-1).to(logits.device)
    if logits.shape[0] != targets.shape[0]:
        raise ValueError(f"{logits.shape[0]} logit rows for {targets.shape[0]} targets")
    if targets.numel() == 0:
        return math.nan
    finite = torch.isfinite(logits).all(-1)
    hit = (logits.argmax(-1) == targets) & finite
    return float(hit.double().mean())


def mean_kl(ref_logits: torch.Tensor, logits: torch.Tensor, chunk: int = 256) -> float:
    """Mean over positions of KL(ref || model) of the next-token distributions, in nats.

    Computed in float64, ``chunk`` positions at a time. NaN if either side is non-finite."""
    ref_logits, logits = _2d(ref_logits), _2d(logits)
    if ref_logits.shape != logits.shape:
        raise ValueError(f"shape mismatch: {tuple(ref_logits.shape)} vs {tuple(logits.shape)}")
    n = ref_logits.shape[0]
    if n == 0 or bool(torch.isnan(ref_logits).any()) or bool(torch.isnan(logits).any()):
        return math.nan
    total = 0.0
    for s in range(0, n, chunk):
        lp = torch.log_softmax(ref_logits[s:s + chunk].double(), -1)
        lq = torch.log_softmax(logits[s:s + chunk].double().to(lp.device), -1)
        # p * (log p - log q), with 0 * log 0 = 0 where the reference puts no mass
        term = torch.where(lp.exp() > 0, lp.exp() * (lp - lq), torch.zeros_like(lp))
        total += float(term.sum())
    return total / n


def perplexity(logits: torch.Tensor, targets: torch.Tensor, chunk: int = 256) -> float:
    """exp(mean negative log-likelihood of ``targets`` under ``logits``) (next-token: row i
    predicts targets[i]). inf/NaN when the model gives a target no probability / NaN."""
    logits = _2d(logits)
    targets = targets.reshape(-1).to(logits.device)
    if logits.shape[0] != targets.shape[0] or targets.numel() == 0:
        raise ValueError(f"{logits.shape[0]} logit rows for {targets.shape[0]} targets")
    nll = 0.0
    for s in range(0, targets.numel(), chunk):
        lp = torch.log_softmax(logits[s:s + chunk].double(), -1)
        nll -= float(lp.gather(-1, targets[s:s + chunk, None]).sum())
    mean = nll / targets.numel()
    if math.isnan(mean):
        return math.nan
    return math.exp(mean) if mean < 700 else math.inf


def recovered_fraction(ref_ppl: float, ppl: float) -> float:
    """Quality kept, as ``ref_ppl / ppl`` (1.0 = as good as the reference; 0 for a model
    without a finite perplexity). Perplexity ratio, so a scheme slightly better than the
    reference on this text can exceed 1."""
    if not math.isfinite(ppl) or not math.isfinite(ref_ppl) or ppl <= 0:
        return 0.0
    return ref_ppl / ppl
