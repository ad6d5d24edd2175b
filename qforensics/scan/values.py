"""Vectorized value checks over a tensor read in chunks.

A tensor arrives as a sequence of `(offset, raw)` chunks: `raw` is a 1-D unsigned-integer view of
consecutive elements starting at flat element `offset`. Ordinary weights are tested for NaN/Inf on
the raw bits (no float decode unless something is non-finite); scale tensors are decoded to float
and also tested for zero, subnormal and FP16-overflowing values. Each check keeps a `Tally`
(count, first flat index, example value) that survives across chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable, Iterable

import numpy as np

from qforensics.formats import FP16_MAX
from qforensics.scan.dtypes import FloatFormat
from qforensics.scan.findings import CHECKS, Finding

__all__ = ["Tally", "FP16_MAX", "tally_float_chunks", "tally_mask", "findings_from_tallies"]



@dataclass
class Tally:
    """Running result of one check over one tensor."""

    count: int = 0
    first_index: int | None = None
    example: float | int | None = None

    def add(self, mask: np.ndarray, values: np.ndarray, offset: int,
            index: np.ndarray | None = None) -> None:
        """Count True entries of `mask`; remember the first one's flat index and value.

        `index`, when given, maps positions of `mask` to flat positions within the chunk.
        """
        n = int(np.count_nonzero(mask))
        if n == 0:
            return
        if self.first_index is None:
            pos = int(np.argmax(mask))
            flat = int(index[pos]) if index is not None else pos
            self.first_index = offset + flat
            v = values[pos]
            self.example = int(v) if np.issubdtype(values.dtype, np.integer) else float(v)
        self.count += n


def tally_mask(tallies: dict[str, Tally], check: str, mask: np.ndarray, values: np.ndarray,
               offset: int) -> None:
    tallies.setdefault(check, Tally()).add(mask, values, offset)


def tally_float_chunks(chunks: Iterable[tuple[int, np.ndarray]], fmt: FloatFormat, *,
                       scale: bool, on_chunk: Callable[[int], None] | None = None
                       ) -> dict[str, Tally]:
    """Run the float checks over raw chunks of one tensor.

    Always: `nan`, `inf`. With `scale`: also `zero_scale`, `subnormal_scale` and, for formats
    wider than FP16 (F32, BF16, F64), `fp16_overflow`. `on_chunk(n_elements)` is called after each
    chunk (progress).
    """
    tallies: dict[str, Tally] = {}
    check_overflow = scale and fmt.max > FP16_MAX
    for offset, raw in chunks:
        if scale:
            vals = fmt.decode(raw)
            _tally_nonfinite(tallies, vals, offset, None)
            tally_mask(tallies, "zero_scale", vals == 0, vals, offset)
            if fmt.tiny > 0:
                mag = np.abs(vals)
                tally_mask(tallies, "subnormal_scale", (mag < fmt.tiny) & (vals != 0), vals,
                           offset)
                if check_overflow:
                    over = (mag > FP16_MAX) & np.isfinite(mag)
                    tally_mask(tallies, "fp16_overflow", over, vals, offset)
        else:
            bad = fmt.nonfinite(raw)
            if bad.any():
                idx = np.flatnonzero(bad)
                _tally_nonfinite(tallies, fmt.decode(raw[idx]), offset, idx)
        if on_chunk is not None:
            on_chunk(int(raw.size))
    return {k: v for k, v in tallies.items() if v.count}


def _tally_nonfinite(tallies: dict[str, Tally], vals: np.ndarray, offset: int,
                     index: np.ndarray | None) -> None:
    nan = np.isnan(vals)
    tallies.setdefault("nan", Tally()).add(nan, vals, offset, index)
    inf = np.isinf(vals)
    tallies.setdefault("inf", Tally()).add(inf, vals, offset, index)


_VERBS = {
    "nan": "are NaN",
    "inf": "are +/-Inf",
    "zero_scale": "are zero",
    "subnormal_scale": "are subnormal",
    "fp16_overflow": "exceed the FP16 range (|s| > 65504; inf once cast to FP16)",
}


def _fmt_value(v: float | int | None) -> str:
    if v is None:
        return "?"
    if isinstance(v, int):
        return str(v)
    return f"{v:.6g}"


def findings_from_tallies(tallies: dict[str, Tally], *, file: str, tensor: str, total: int,
                          what: str = "values", block_elems: int | None = None,
                          blocks_per_row: int | None = None) -> list[Finding]:
    """Turn tallies into findings, in the fixed order of CHECKS.

    With `block_elems`, tally indices are block indices: the finding carries `block_index` and
    `first_index` = block_index * block_elems (flat index of the block's first element).
    """
    out: list[Finding] = []
    for check in CHECKS:
        t = tallies.get(check)
        if t is None or t.count == 0 or t.first_index is None:
            continue
        severity = CHECKS[check][0]
        verb = _VERBS.get(check, check)
        if block_elems is not None:
            block = t.first_index
            flat = block * block_elems
            where = f"block {block}"
            if blocks_per_row:
                where += f" (row {block // blocks_per_row}, flat index {flat})"
            else:
                where += f" (flat index {flat})"
        else:
            block = None
            flat = t.first_index
            where = f"flat index {flat}"
        message = (f"{t.count} of {total} {what} {verb}; first at {where}, "
                   f"value {_fmt_value(t.example)}")
        out.append(Finding(file=file, tensor=tensor, check=check, severity=severity,
                           count=t.count, first_index=flat, block_index=block,
                           example=t.example, total=total, message=message))
    return out
