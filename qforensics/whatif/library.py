"""What-if schemes a real quantization library implements, measured through that library.

``ct:PRESET[-g<N>]`` (e.g. ``ct:W4A16``, ``ct:W8A16``, ``ct:W4A16_ASYM``, ``ct:FP8_DYNAMIC``,
``ct:W8A8``; ``-g<N>`` sets the group size of a group-strategy preset, as an llmcompressor
recipe may) is compressed-tensors' own preset scheme: `applied_compressed_tensors` attaches it
with the library's ``apply_quantization_config`` (every Linear but lm_head), sets each weight's
scale and zero point with the library's ``calculate_qparams`` from the weight's min/max per
tensor / channel / group, and the forward the library installs quantizes the weights (and
dynamic activations) on the fly with its own kernels' math. Presets whose activations need a
calibrated static scale, or whose weights use block strategies, are refused with a reason;
Linears whose in_features the group size does not divide are left unquantized.
Everything the library added to the model is removed on exit.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
from collections.abc import Iterator
from typing import Any

from qforensics.errors import UsageError

__all__ = ["LIBRARY_PREFIXES", "applied_compressed_tensors", "check_compressed_tensors_preset"]

LIBRARY_PREFIXES = {"ct": "compressed-tensors", "compressed-tensors": "compressed-tensors"}


def _require() -> None:
    if importlib.util.find_spec("compressed_tensors") is None:
        raise UsageError("ct: schemes run through compressed-tensors, which is not installed: "
                         "pip install 'qforensics[layers]'")


def check_compressed_tensors_preset(preset: str) -> Any:
    """The library's QuantizationScheme for ``preset`` (UsageError when unknown/unsupported)."""
    _require()
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    m = re.match(r"^([A-Z0-9_]+?)(?:-G(\d+))?$", preset.strip().upper())
    name, group = (m.group(1), m.group(2)) if m else (preset.strip().upper(), None)
    if name not in PRESET_SCHEMES:
        raise UsageError(f"ct:{preset}: not a compressed-tensors preset; known: "
                         f"{', '.join(sorted(PRESET_SCHEMES))}")
    scheme = preset_name_to_scheme(name, ["Linear"])
    w = scheme.weights
    if w is None:
        raise UsageError(f"ct:{name} quantizes no weights: nothing to compare")
    if group is not None:
        if str(getattr(w.strategy, "value", w.strategy)) != "group" or int(group) < 1:
            raise UsageError(f"ct:{preset}: -g<N> sets the group size of a group-strategy "
                             f"preset; {name} quantizes its weights per "
                             f"{getattr(w.strategy, 'value', w.strategy)}")
        w = w.model_copy(update={"group_size": int(group)})
        scheme = scheme.model_copy(update={"weights": w})
    if str(getattr(w.strategy, "value", w.strategy)) not in ("tensor", "channel", "group"):
        raise UsageError(f"ct:{name}: weight strategy {w.strategy} is not supported here "
                         "(tensor, channel or group)")
    if w.type != "int" and str(getattr(w.type, "value", w.type)) != "int" and \
            str(getattr(w.type, "value", w.type)) != "float":
        raise UsageError(f"ct:{name}: weight type {w.type} is not supported here")
    act = scheme.input_activations
    if act is not None and act.dynamic is False:
        raise UsageError(f"ct:{name}: its activations need a calibrated static scale; use a "
                         "dynamic preset (e.g. ct:FP8_DYNAMIC) or a weight-only one (ct:W4A16)")
    return scheme


def _minmax(weight: Any, args: Any) -> tuple[Any, Any]:
    """min/max of the weight per the strategy's unit: tensor [1], channel [N, 1], group
    [N, K/G]; zero included, as the library's min-max observer does."""
    import torch

    w = weight.detach().float()
    strategy = str(getattr(args.strategy, "value", args.strategy))
    if strategy == "tensor":
        lo, hi = w.min().reshape(1), w.max().reshape(1)
    elif strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    else:
        g = int(args.group_size)
        if w.shape[1] % g:
            raise UsageError(f"group size {g} does not divide in_features {w.shape[1]}")
        wg = w.reshape(w.shape[0], -1, g)
        lo, hi = wg.amin(2), wg.amax(2)
    zero = torch.zeros_like(lo)
    return torch.minimum(lo, zero), torch.maximum(hi, zero)


@contextlib.contextmanager
def applied_compressed_tensors(model: Any, preset: str,
                               exclude: tuple[str, ...] = ("lm_head",)) -> Iterator[int]:
    """Quantize ``model`` with compressed-tensors' ``preset`` for the duration; yields how many
    Linears the library took."""
    import torch
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = check_compressed_tensors_preset(preset)
    before = {name: (set(m.__dict__), set(m._parameters), set(m._buffers))
              for name, m in model.named_modules()}
    ignore = [f"re:.*{re.escape(e)}$" for e in exclude]
    w = scheme.weights
    if str(getattr(w.strategy, "value", w.strategy)) == "group":  # the library only warns
        ignore += [f"re:^{re.escape(name)}$" for name, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and m.in_features % int(w.group_size)]
    cfg = QuantizationConfig(config_groups={"whatif": scheme}, ignore=ignore)
    try:
        apply_quantization_config(model, cfg)
        n = 0
        with torch.no_grad():
            for _, mod in model.named_modules():
                sch = getattr(mod, "quantization_scheme", None)
                if sch is None or sch.weights is None or not hasattr(mod, "weight_scale"):
                    continue
                lo, hi = _minmax(mod.weight, sch.weights)
                scale, zp = calculate_qparams(lo, hi, sch.weights)
                mod.weight_scale.data = scale.reshape(mod.weight_scale.shape).to(
                    mod.weight_scale.dtype)
                if getattr(mod, "weight_zero_point", None) is not None:
                    mod.weight_zero_point.data = zp.reshape(mod.weight_zero_point.shape).to(
                        mod.weight_zero_point.dtype)
                n += 1
        if n == 0:
            raise UsageError(f"ct:{preset}: compressed-tensors took no Linear of "
                             f"{type(model).__name__}")
        yield n
    finally:
        for name, mod in model.named_modules():
            d, p, b = before.get(name, (set(), set(), set()))
            for k in set(mod._parameters) - p:
                del mod._parameters[k]
            for k in set(mod._buffers) - b:
                del mod._buffers[k]
            for k in set(mod.__dict__) - d:  # the wrapped forward, scheme, status
                del mod.__dict__[k]
