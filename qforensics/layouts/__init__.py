"""The one place that knows how quantized weights are laid out (torch-free: numpy, ml_dtypes).

- `bits`: codes packed in int32 words (sequential bit stream; AWQ's nibble order).
- `awq`, `gptq`, `compressed`, `fp8`, `vllm_cpu`: each format's decoder to the float weight
  W [K, N] (y = x @ W), its shape checks, and its conventions written down once.
- `registry`: the layouts as checked adapters over numpy tensors, ``can_take -> reason``.
- `detect`: which layout a layer holds, one spelling per name (what the trace's readers report).
- `torch_adapters`: the only torch module here: library layers -> the decoders.

Number-format limits stay in qforensics.formats.
"""

from qforensics.layouts.bits import AWQ_ORDER, AWQ_REVERSE, LayoutError
from qforensics.layouts.detect import DECODED, FORMATS, Detected, detect
from qforensics.layouts.registry import LAYOUTS, NAMED_ONLY, REPACKED, Layout

__all__ = ["AWQ_ORDER", "AWQ_REVERSE", "DECODED", "FORMATS", "LAYOUTS", "NAMED_ONLY", "REPACKED",
           "Detected", "Layout", "LayoutError", "detect"]
