"""Fake-quantization emulation: what a quantized deployment would compute, in plain torch.

Used by the demo scenarios (run SmolLM2 under a scheme), the what-if command and the runtime
guard. Everything is vectorized torch, keeps the input's dtype and device, and is deterministic.

- `fake_quant_int` / `int_scales`: INT4/INT8 symmetric RTN, per-tensor / per-channel /
  per-token / group-wise (`qforensics.quant.integer`).
- `fake_quant_fp8` / `probe_fp8_cast`: FP8 e4m3 / e5m2, saturating or NaN-on-overflow
  (`qforensics.quant.fp8`).
- `parse_scheme` / `QuantScheme`: spec strings such as ``int4-g128``, ``fp8-e4m3-nosat``,
  ``int4-g128-salient1pct`` (`qforensics.quant.scheme`).
- `quantize_weights`, `quantize_activations`, `collect_input_absmax`: apply to a model
  (`qforensics.quant.model`).
- `select_salient_channels`, `quantize_weight_salient`: AWQ-style outlier protection
  (`qforensics.quant.salient`).

Example::

    from qforensics.quant import quantize_activations, quantize_weights

    with quantize_weights(model, "int4-g128"):          # weights restored on exit
        with quantize_activations(model, "fp8-e4m3-nosat"):
            logits = model(ids).logits                   # NaN where a Linear input > 448
"""

from __future__ import annotations

from qforensics.quant.errors import QuantApplyError, QuantSchemeError
from qforensics.quant.fp8 import FP8_FORMATS, fake_quant_fp8, probe_fp8_cast, round_to_fp8_grid
from qforensics.quant.integer import fake_quant_int, int_qmax, int_scales
from qforensics.quant.model import (
    ActivationQuant,
    WeightBackup,
    FakeQuantLinear,
    collect_input_absmax,
    emulate_quantized_linears,
    find_linears,
    quantize_activations,
    quantize_weights,
)
from qforensics.quant.salient import quantize_weight_salient, select_salient_channels
from qforensics.quant.scheme import VALID_FORMS, QuantScheme, parse_scheme

__all__ = [
    "FP8_FORMATS",
    "VALID_FORMS",
    "ActivationQuant",
    "QuantApplyError",
    "QuantScheme",
    "QuantSchemeError",
    "WeightBackup",
    "FakeQuantLinear",
    "collect_input_absmax",
    "emulate_quantized_linears",
    "fake_quant_fp8",
    "fake_quant_int",
    "find_linears",
    "int_qmax",
    "int_scales",
    "parse_scheme",
    "probe_fp8_cast",
    "quantize_activations",
    "quantize_weight_salient",
    "quantize_weights",
    "round_to_fp8_grid",
    "select_salient_channels",
]
