"""What kind of layer a module is, shared by capture (hooks/) and the guard (guard/) so neither
has to import the other. Torch-free: it reads class names, the class hierarchy and attribute
names (duck typing), so it imports nothing heavy."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["LINEAR_CLASS_NAME", "QUANT_ATTRS", "is_linear_like"]

# Class names of quantized / special linears from common libraries (matched on type name so we
# never import those libraries): AutoAWQ WQLinear_*, GPTQ/AutoGPTQ/GPTQModel QuantLinear,
# bitsandbytes Linear4bit/Linear8bitLt, FP8 linears, transformers' GPT-2 Conv1D, Marlin, Exllama.
LINEAR_CLASS_NAME = re.compile(
    r"(WQLinear|QuantLinear|Linear4bit|Linear8bitLt|FP8Linear|Fp8Linear|Float8Linear|"
    r"Int8Linear|MarlinLinear|ExllamaLinear|QLinear|^Conv1D$|Linear$)"
)
# Attributes whose presence says a module's weight is stored quantized.
QUANT_ATTRS = ("qweight", "qzeros", "scales", "g_idx", "weight_scale", "input_scale",
               "weight_zero_point", "SCB", "weight_packed")
_CONTAINERS = {("torch.nn.modules.container", "ModuleList"),
               ("torch.nn.modules.container", "Sequential")}


def _is_tensor(obj: Any) -> bool:
    return any(c.__name__ == "Tensor" and c.__module__ == "torch" for c in type(obj).__mro__)


def _derives(module: Any, names: set[tuple[str, str]]) -> bool:
    return any((c.__module__, c.__name__) in names for c in type(module).__mro__)


def is_linear_like(module: Any) -> bool:
    """nn.Linear and its subclasses, packed-weight layers (``qweight``), and library linears
    matched by class name that carry a weight or a quantization tensor."""
    if _derives(module, {("torch.nn.modules.linear", "Linear")}):
        return True
    if _is_tensor(getattr(module, "qweight", None)):
        return True
    if _derives(module, _CONTAINERS):
        return False
    if LINEAR_CLASS_NAME.search(type(module).__name__):
        # a serving engine may hand the weight to its kernel and drop it from the layer (vLLM's
        # oneDNN INT8 path keeps only the scales): its quantization tensors still mark it
        return (_is_tensor(getattr(module, "weight", None)) or hasattr(module, "qweight")
                or any(_is_tensor(getattr(module, a, None)) for a in QUANT_ATTRS))
    return False
