"""What-if: how would this run have gone under another quantization scheme?

``qforensics whatif trace.h5 --scheme int4-g128 --keep-salient 1%`` reruns the trace's prompt
on the real model quantized with the scheme - salient channels chosen from the activation
ranges the trace recorded - and compares with the unquantized reference: teacher-forced top-1
agreement, mean KL, and perplexity on a fixed text. ``--table`` runs the scenario schemes.

- `run_whatif` / `WhatIfResult`: the run and its results (`qforensics.whatif.run`).
- `absmax_from_trace`: per-input-channel activation absmax from a trace
  (`qforensics.whatif.salient`).
- `top1_agreement`, `mean_kl`, `perplexity`, `recovered_fraction` (`qforensics.whatif.metrics`).

Importing this package does not import torch; the functions that run the model do.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "TABLE_SCHEMES",
    "WhatIfResult",
    "absmax_from_trace",
    "mean_kl",
    "parse_keep_salient",
    "parse_whatif_scheme",
    "perplexity",
    "recovered_fraction",
    "run_whatif",
    "top1_agreement",
]

_WHERE = {
    "TABLE_SCHEMES": "run", "WhatIfResult": "run", "parse_keep_salient": "run",
    "parse_whatif_scheme": "run", "run_whatif": "run", "absmax_from_trace": "salient",
    "mean_kl": "metrics", "perplexity": "metrics", "recovered_fraction": "metrics",
    "top1_agreement": "metrics",
}


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'qforensics.whatif' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"qforensics.whatif.{mod}"), name)
