"""The analyzer's thresholds and their defaults (format limits: qforensics.formats). No torch."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from qforensics.errors import UsageError


@dataclass(frozen=True)
class Thresholds:
    """Every knob of `analyze_trace`; pass any of them as keyword arguments."""

    ratio: float = 20.0  # channel absmax / median channel absmax of its module
    absolute: float = 100.0  # channel absmax that stands out on its own
    top: int = 10  # outlier channels, modules per scheme, precursors listed
    persistent_min_modules: int = 3  # a dim standing out in at least this many modules
    unsafe_fraction: float = 0.5  # a scheme is unsafe for a module zeroing this share of channels
    trend_steps: int = 16  # earlier steps read for an outlier channel's trend (evenly sampled)
    logits_growth_steps: int = 3  # consecutive rising steps of max |logit| that count as growth
    logits_growth_factor: float = 4.0  # ... and by at least this factor overall
    logits_extreme: float = 1000.0  # max |logit| that looks broken on its own
    repeat_tokens: int = 8  # the same argmax (or a cycle of <= 4) repeated this many times
    entropy_low: float = 0.01  # nats: entropy collapse (with a drop from the run's median)
    entropy_uniform: float = 0.95  # share of log(vocab): near-uniform logits
    agreement_min: float = 0.5  # outcome meta: teacher-forced top-1 agreement below this

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or math.isnan(v) or v < 0:
                raise UsageError(f"threshold {f.name} must be a non-negative number, got {v!r}")
        if self.top < 1:
            raise UsageError("top must be at least 1")

    @classmethod
    def from_kwargs(cls, **kw: Any) -> Thresholds:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kw) - names)
        if unknown:
            raise UsageError(f"unknown threshold(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(names))}")
        return cls(**{k: v for k, v in kw.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
