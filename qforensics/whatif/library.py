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

``ct:PART=PRESET,PART=PRESET[,keep=NAME]...`` (e.g. ``ct:mlp=W4A16-g64,attn=W8A8,keep=
model.layers.11.mlp.down_proj``) is a mixed recipe, as deployments mix INT4 and 8-bit layers:
each part is one of the library's config groups, its preset applied to the Linears with PART in
a name component above the Linear's own (``mlp`` takes ``...mlp.down_proj``, ``attn`` takes
``...self_attn.q_proj``), and each ``keep=`` Linear stays in bf16 through the library's
``ignore`` list. A Linear in two parts is refused; one in no part stays unquantized.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from qforensics.errors import UsageError

__all__ = ["LIBRARY_PREFIXES", "CtRecipe", "applied_compressed_tensors",
           "check_compressed_tensors_preset", "parse_ct_recipe"]

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


@dataclass(frozen=True)
class CtRecipe:
    """A mixed compressed-tensors recipe: (part, preset) pairs and the Linears kept in bf16."""

    parts: tuple[tuple[str, str], ...]
    keep: tuple[str, ...] = ()

    @property
    def text(self) -> str:
        """The canonical spelling (the scheme's label after ``ct:``)."""
        return ",".join([f"{k}={p}" for k, p in self.parts] + [f"keep={n}" for n in self.keep])

    def part_of(self, name: str) -> str | None:
        """The part whose key is in a component of ``name`` above its last (None: no part)."""
        above = name.split(".")[:-1]
        hits = [k for k, _ in self.parts if any(k in c for c in above)]
        if len(hits) > 1:
            raise UsageError(f"ct:{self.text}: {name} is in two parts ({', '.join(hits)}); "
                             "use keys that pick distinct Linears")
        return hits[0] if hits else None


def parse_ct_recipe(text: str) -> CtRecipe | None:
    """``PART=PRESET,...[,keep=NAME...]`` as a `CtRecipe` (each preset checked); None when
    ``text`` is a single preset. UsageError when malformed."""
    if "=" not in text:
        return None
    parts: list[tuple[str, str]] = []
    keep: list[str] = []
    for item in (x.strip() for x in text.split(",")):
        m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)=([A-Za-z0-9_.-]+)$", item)
        if not m:
            raise UsageError(f"ct:{text}: {item!r} is not PART=PRESET or keep=LINEAR "
                             "(e.g. ct:mlp=W4A16-g64,attn=W8A8,keep=model.layers.11.mlp.down_proj)")
        key, val = m.group(1).lower(), m.group(2)
        if key == "keep":
            keep.append(val)
            continue
        if any(k == key for k, _ in parts):
            raise UsageError(f"ct:{text}: part {key!r} is given twice")
        preset = re.sub(r"-G(\d+)$", r"-g\1", val.upper())
        check_compressed_tensors_preset(preset)
        parts.append((key, preset))
    if not parts:
        raise UsageError(f"ct:{text}: a recipe needs at least one PART=PRESET")
    return CtRecipe(tuple(parts), tuple(dict.fromkeys(keep)))


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
    from compressed_tensors.quantization import apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams

    before = {name: (set(m.__dict__), set(m._parameters), set(m._buffers))
              for name, m in model.named_modules()}
    cfg = _quantization_config(model, preset, exclude)
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


def _undivided(linears: dict[str, Any], scheme: Any) -> list[str]:
    """Linears whose in_features a group-strategy scheme's group size does not divide."""
    w = scheme.weights
    if str(getattr(w.strategy, "value", w.strategy)) != "group":
        return []
    return [n for n, m in linears.items() if m.in_features % int(w.group_size)]


def _quantization_config(model: Any, preset: str, exclude: tuple[str, ...]) -> Any:
    """The library's QuantizationConfig for a preset (every Linear: target ``Linear``) or a
    recipe (one config group per part, targeting its Linears by name)."""
    import torch
    from compressed_tensors.quantization import QuantizationConfig

    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    ignore = [f"re:.*{re.escape(e)}$" for e in exclude]
    recipe = parse_ct_recipe(preset)
    if recipe is None:
        scheme = check_compressed_tensors_preset(preset)
        ignore += [f"re:^{re.escape(n)}$" for n in _undivided(linears, scheme)]  # it only warns
        return QuantizationConfig(config_groups={"whatif": scheme}, ignore=ignore)
    missing = [n for n in recipe.keep if n not in linears]
    if missing:
        raise UsageError(f"ct:{recipe.text}: keep={missing[0]} is not a Linear of "
                         f"{type(model).__name__} (e.g. {next(iter(linears), '?')})")
    groups = {}
    left = [n for n in linears if not any(n.endswith(e) for e in exclude)
            and n not in recipe.keep]
    for key, name in recipe.parts:
        scheme = check_compressed_tensors_preset(name)
        mine = {n: linears[n] for n in left if recipe.part_of(n) == key}
        bad = set(_undivided(mine, scheme))
        names = sorted(n for n in mine if n not in bad)
        if not names:
            raise UsageError(f"ct:{recipe.text}: part {key}={name} takes no Linear of "
                             f"{type(model).__name__}")
        groups[key] = scheme.model_copy(
            update={"targets": [f"re:^({'|'.join(map(re.escape, names))})$"]})
        ignore += [f"re:^{re.escape(n)}$" for n in sorted(bad)]
    ignore += [f"re:^{re.escape(n)}$" for n in recipe.keep]  # kept in bf16
    return QuantizationConfig(config_groups=groups, ignore=ignore)
