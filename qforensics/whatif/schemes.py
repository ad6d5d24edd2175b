"""What-if scheme specs: ``[w:|act:]SPEC[+...]`` (the project's fake-quant schemes),
``ct:PRESET[-g<N>]`` (compressed-tensors' own presets) or
``ct:PART=PRESET,...[,keep=LINEAR]`` (a mixed recipe of them), ``llmc:GPTQ-PRESET[-g<N>]`` /
``llmc:SQ-W8A8`` (llmcompressor's calibration) and ``awq:w4a16[-g<N>]`` (AWQ W4A16 in
its published format), both also measurable through vLLM, parsed into a `WhatIfScheme`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from qforensics.errors import UsageError

__all__ = ["TABLE_SCHEMES", "WhatIfScheme", "parse_keep_salient", "parse_whatif_scheme"]

# The scenario schemes, as what-if specs (weights "w:", activations "act:")
TABLE_SCHEMES: tuple[str, ...] = (
    "w:int4-per-tensor",
    "w:int4-g128",
    "w:int4-g128-salient1pct",
    "act:int8-per-tensor",
    "act:fp8-e4m3-nosat",
    "act:fp8-e4m3",
)

_PREFIX = {"w": "weights", "weights": "weights", "a": "activations", "act": "activations",
           "activations": "activations"}


@dataclass(frozen=True)
class WhatIfScheme:
    """A weight scheme and/or an activation scheme, applied together."""

    label: str
    weights: Any = None  # QuantScheme
    activations: Any = None  # QuantScheme
    library: str | None = None  # "compressed-tensors": the library's own preset, ``preset``
    preset: str | None = None
    algo: str | None = None  # "llmcompressor": its calibrating recipe (gptq, sq-gptq)

    @property
    def awq_group(self) -> int:
        """The group size of an ``awq:w4a16-g<N>`` scheme."""
        return int(str(self.preset).rsplit("-g", 1)[-1])

    @property
    def needs_salient(self) -> bool:
        return self.weights is not None and self.weights.keep_salient is not None


def parse_keep_salient(text: str | float | None) -> float | None:
    """``"1%"`` -> 0.01, ``"0.01"`` -> 0.01; None passes through. UsageError when invalid."""
    if text is None:
        return None
    raw = str(text).strip()
    try:
        val = float(raw[:-1]) / 100.0 if raw.endswith("%") else float(raw)
    except ValueError:
        raise UsageError(f"--keep-salient {raw!r}: expected a percentage like 1% or a fraction "
                         "like 0.01") from None
    if not 0.0 < val < 1.0:
        raise UsageError(f"--keep-salient {raw!r}: must be between 0% and 100% (exclusive)")
    return val


# -- llmc: specs (llmcompressor's calibration, in its own venv: qforensics.whatif.llmc) -------
LLMC_SPEC = re.compile(r"^(?:llmc|llmcompressor):(GPTQ|SQ)-([A-Za-z0-9_]+?)(?:-g(\d+))?$",
                       re.IGNORECASE)
_ALGO = {"GPTQ": "gptq", "SQ": "sq-gptq"}


def parse_llmc(spec: str) -> WhatIfScheme | None:
    """The `WhatIfScheme` of an ``llmc:`` spec (llmcompressor's calibration, run by
    qforensics.whatif.llmc), None when ``spec`` is not one."""
    m = LLMC_SPEC.match(spec.strip())
    if m is None:
        if re.match(r"^(llmc|llmcompressor):", spec.strip(), re.IGNORECASE):
            raise UsageError(f"{spec}: expected llmc:GPTQ-PRESET[-g<N>] (llmc:GPTQ-W4A16-g64) "
                             "or llmc:SQ-W8A8 (SmoothQuant + GPTQ)")
        return None
    from qforensics.whatif.library import check_compressed_tensors_preset

    algo, name, group = m.group(1).upper(), m.group(2).upper(), m.group(3)
    preset = name + (f"-g{int(group)}" if group else "")
    scheme = check_compressed_tensors_preset(preset)
    if str(getattr(scheme.weights.type, "value", scheme.weights.type)) != "int":
        raise UsageError(f"{spec}: GPTQ calibrates integer weights; {name} is "
                         f"{scheme.weights.type} (measure it with ct:{name})")
    if algo == "SQ" and scheme.input_activations is None:
        raise UsageError(f"{spec}: SmoothQuant moves activation outliers into the weights, for "
                         f"schemes that quantize activations (llmc:SQ-W8A8); {name} does not")
    return WhatIfScheme(f"llmc:{algo}-{preset}", library="llmcompressor", preset=preset,
                        algo=_ALGO[algo])


def parse_whatif_scheme(spec: str, keep_salient: float | None = None) -> WhatIfScheme:
    """Parse ``[w:|act:]SPEC[+[w:|act:]SPEC]``.

    Without a prefix, ``fp8-*`` and ``*-per-token`` specs are activation schemes and other INT
    specs are weight schemes. ``keep_salient`` adds salient protection to the INT weight part.
    Raises `QuantSchemeError` (a UsageError) for a bad spec.
    """
    from qforensics.quant import parse_scheme
    from qforensics.quant.errors import QuantSchemeError

    if not isinstance(spec, str) or not spec.strip():
        raise QuantSchemeError("empty what-if scheme; e.g. int4-g128 or act:fp8-e4m3-nosat")
    llmc = parse_llmc(spec)  # llmcompressor's calibration, in its own venv (whatif.llmc)
    if llmc is not None:
        return llmc
    mixed = re.match(r"^(?:ct|compressed-tensors):(.*=.*)$", spec.strip(), re.IGNORECASE)
    if mixed:  # a mixed recipe: one config group per part (qforensics.whatif.library)
        from qforensics.whatif.library import parse_ct_recipe

        recipe = parse_ct_recipe(mixed.group(1))
        assert recipe is not None
        return WhatIfScheme(f"ct:{recipe.text}", library="compressed-tensors",
                            preset=recipe.text)
    lib = re.match(r"^(ct|compressed-tensors):([A-Za-z0-9_]+(?:-g\d+)?)$", spec.strip(),
                   re.IGNORECASE)
    if lib:  # a real library's preset, measured through it (qforensics.whatif.library)
        from qforensics.whatif.library import check_compressed_tensors_preset

        preset = re.sub(r"-G(\d+)$", r"-g\1", lib.group(2).upper())
        check_compressed_tensors_preset(preset)
        return WhatIfScheme(f"ct:{preset}", library="compressed-tensors", preset=preset)
    from qforensics.whatif.checkpoints import awq_group

    group = awq_group(spec)
    if group is not None:  # AWQ W4A16: the published format, also servable by vLLM
        return WhatIfScheme(f"awq:w4a16-g{group}", library="awq", preset=f"w4a16-g{group}")
    weights = activations = None
    for part in spec.strip().split("+"):
        part = part.strip()
        target = None
        m = re.match(r"^([a-z]+):(.*)$", part, re.IGNORECASE)
        if m:
            target = _PREFIX.get(m.group(1).lower())
            if target is None:
                raise QuantSchemeError(f"bad what-if scheme {spec!r}: prefix {m.group(1)!r} is "
                                       "not w: (weights) or act: (activations)")
            part = m.group(2).strip()
        if target is None:
            low = part.lower()
            target = ("activations" if low.startswith("fp8") or "per-token" in low
                      else "weights")
        if target == "weights":
            if weights is not None:
                raise QuantSchemeError(f"bad what-if scheme {spec!r}: two weight schemes")
            ks = keep_salient
            if ks is not None and (part.lower().startswith("fp8") or "salient" in part.lower()):
                ks = None  # fp8 cannot; an explicit -salient suffix wins
            weights = parse_scheme(part, "weights", keep_salient=ks)
        else:
            if activations is not None:
                raise QuantSchemeError(f"bad what-if scheme {spec!r}: two activation schemes")
            activations = parse_scheme(part, "activations")
    label = "+".join(x for x in (f"w:{weights}" if weights else "",
                                 f"act:{activations}" if activations else "") if x)
    return WhatIfScheme(label, weights, activations)
