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
    collapse_scale: float = 2.0  # a collapse / loop counts when the logits' scale is >= this x
    # the request's own median before it (logits std / max |logit|; docs/thresholds.md)
    entropy_uniform: float = 0.95  # share of log(vocab): near-uniform logits
    agreement_min: float = 0.5  # outcome meta: teacher-forced top-1 agreement below this
    param_zero_share: float = 0.5  # a weight with more than this share of exact zeros
    param_levels: float = 3.0  # median distinct values per weight group at most this
    param_dominated: float = 0.5  # share of a weight's groups whose scale one weight sets
    static_overrun: float = 4.0  # recorded |input| / (input_scale x format max)
    degenerate_steps: int = 4  # steps whose argmax is vocab id 0

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

    @classmethod
    def recorded(cls, d: dict[str, Any] | None) -> Thresholds:
        """The thresholds a findings document records (`Findings.thresholds`); defaults for any
        it lacks or records badly."""
        names = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in (d or {}).items() if k in names})
        except (UsageError, TypeError):
            return cls()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Why each silent-failure threshold sits where it does (printed in `analyze --json`).
RATIONALE: dict[str, str] = {
    "param_zero_share": "trained weights are dense (<1% exact zeros unquantized, ~10-20% under "
                        "INT4 group-128 round-to-nearest); more than half zeros means the "
                        "quantization scale is far too coarse for most weights",
    "param_levels": "a group with at most 3 distinct values is ternary {-s, 0, s}: INT4 "
                    "group-wise keeps about 10-16 per group, float weights about one per weight",
    "param_dominated": "a group whose largest |weight| is at least twice every other is scaled "
                       "for that one weight; the rest use at most half the grid. Unquantized "
                       "and group-wise weights show this in about 1% of groups",
    "static_overrun": "an input at 4x what input_scale x format max can represent keeps at "
                      "most a quarter of its magnitude when it saturates; a scale calibrated on "
                      "the prompt sees decode tokens overrun it by up to ~2.3x harmlessly "
                      "(measured on SmolLM2 FP8, text identical to the reference)",
    "degenerate_steps": "vocab id 0 is a special token; greedy decoding lands on it repeatedly "
                        "when the logits are flat or NaN (the '!!!!!!' / <|endoftext|> output)",
    "repeat_tokens": "a greedy loop of at most 4 tokens covering 8 tokens of one request is a "
                     "repetition loop; healthy SmolLM2 loops too (up to 128 tokens of '8' in "
                     "8 x 400 greedy tokens), so it counts only with collapse_scale "
                     "(docs/thresholds.md)",
    "entropy_low": "entropy below 0.01 nats after a median ten times higher; healthy greedy "
                   "decoding is that certain for dozens of steps, so it counts only with "
                   "collapse_scale (docs/thresholds.md)",
    "collapse_scale": "during a healthy collapse the logits' std stays within x1.11 of the "
                      "request's own median before it, during a healthy loop max |logit| within "
                      "x1.51 (greedy and sampled HF runs, vLLM 8 x 400); a broken scale moves "
                      "them by its factor",
    "entropy_uniform": "entropy at 95% of log(vocabulary) is noise: no token preferred",
    "unsafe_fraction": "a scheme that rounds at least half a module's input channels to zero "
                       "destroys that module's input",
}
