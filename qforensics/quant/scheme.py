"""Quantization scheme specs: parse ``"int4-g128"``-style strings into a `QuantScheme`.

Grammar (case-insensitive)::

    int4|int8 - per-tensor | per-channel | per-token | g<N>   [-salient<P>pct]
    fp8-e4m3|fp8-e5m2 [-nosat] [-dynamic]

- ``per-channel`` (one scale per output row) is for weights; ``per-token`` (dynamic, one scale
  per token) is for activations; ``per-tensor`` and ``g<N>`` (groups of N along the last /
  input dim, e.g. g32, g64, g128) are for both.
- ``-salient<P>pct`` (weights only, e.g. ``int4-g128-salient1pct``): keep the top P% input
  channels by calibration activation absmax in FP16, AWQ-style (see `qforensics.quant.salient`).
- ``fp8-*`` saturates by default; ``-nosat`` turns out-of-range values into NaN; ``-dynamic``
  uses a per-tensor ``amax / max`` scale instead of the static scale 1.

A scheme also has a target, ``"weights"`` or ``"activations"``, given to `parse_scheme`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from qforensics.formats import canonical_format
from qforensics.quant.errors import QuantSchemeError

__all__ = ["QuantScheme", "Target", "VALID_FORMS", "parse_scheme"]

Target = Literal["weights", "activations"]

VALID_FORMS: tuple[str, ...] = (
    "int4-per-tensor",
    "int4-per-channel (weights)",
    "int4-per-token (activations)",
    "int4-g32 | int4-g64 | int4-g128 (any g<N>)",
    "int8-per-tensor | int8-per-channel | int8-per-token | int8-g<N>",
    "int4-g128-salient1pct (weights; any salient<P>pct, 0 < P < 100)",
    "fp8-e4m3 | fp8-e5m2, optionally with -nosat and/or -dynamic (e.g. fp8-e4m3-nosat)",
)

_INT_RE = re.compile(
    r"^int(?P<bits>4|8)-(?P<gran>per-tensor|per-channel|per-token|g(?P<gs>\d+))"
    r"(?:-salient(?P<pct>\d+(?:\.\d+)?)pct)?$"
)
_FP8_RE = re.compile(r"^fp8-(?P<fmt>e4m3|e4m3fn|e5m2)(?P<mods>(?:-(?:nosat|dynamic))*)$")


@dataclass(frozen=True)
class QuantScheme:
    """One fake-quant scheme. Build it with `parse_scheme`; ``str(scheme)`` is its spec."""

    kind: Literal["int", "fp8"]
    target: Target = "weights"
    bits: int = 8
    granularity: Literal["per-tensor", "per-channel", "per-token", "group"] = "per-tensor"
    group_size: int | None = None
    fp8_format: Literal["e4m3", "e5m2"] = "e4m3"
    saturate: bool = True
    dynamic_scale: bool = False
    keep_salient: float | None = None

    def __str__(self) -> str:
        if self.kind == "fp8":
            spec = f"fp8-{self.fp8_format}"
            spec += "" if self.saturate else "-nosat"
            return spec + ("-dynamic" if self.dynamic_scale else "")
        gran = f"g{self.group_size}" if self.granularity == "group" else self.granularity
        spec = f"int{self.bits}-{gran}"
        if self.keep_salient is not None:
            spec += f"-salient{self.keep_salient * 100:g}pct"
        return spec

    def fake_quant(
        self, x: torch.Tensor, salient_channels: torch.Tensor | Sequence[int] | None = None
    ) -> torch.Tensor:
        """Quantize-dequantize one tensor (a ``[N, K]`` weight or an activation ``[..., K]``).

        A scheme with ``keep_salient`` needs ``salient_channels`` (input-channel indices, see
        `qforensics.quant.salient.select_salient_channels`); others ignore it unless given, in
        which case those columns are kept in FP16 too.
        """
        if self.kind == "fp8":
            if salient_channels is not None:
                raise QuantSchemeError(f"{self}: salient-channel protection is INT-only")
            from qforensics.quant.fp8 import fake_quant_fp8

            return fake_quant_fp8(
                x,
                self.fp8_format,
                saturate=self.saturate,
                scale="dynamic" if self.dynamic_scale else None,
            )
        if self.keep_salient is not None and salient_channels is None:
            raise QuantSchemeError(
                f"{self} keeps salient channels: pass salient_channels (pick them with "
                "select_salient_channels on calibration absmax from collect_input_absmax)"
            )
        if salient_channels is not None:
            from qforensics.quant.salient import quantize_weight_salient

            return quantize_weight_salient(
                x,
                salient_channels,
                bits=self.bits,
                granularity=self.granularity,
                group_size=self.group_size,
            )
        from qforensics.quant.integer import fake_quant_int

        return fake_quant_int(x, self.bits, self.granularity, self.group_size)


def _bad(spec: object, why: str) -> QuantSchemeError:
    forms = "\n  ".join(VALID_FORMS)
    return QuantSchemeError(f"bad quantization scheme {spec!r}: {why}. Valid forms:\n  {forms}")


def parse_scheme(
    spec: str | QuantScheme,
    target: Target = "weights",
    *,
    keep_salient: float | None = None,
) -> QuantScheme:
    """Parse ``spec`` (see the module docstring) for ``target``; raise `QuantSchemeError`.

    ``keep_salient`` (a fraction in (0, 1), e.g. 0.01) adds salient protection to an INT weight
    scheme; it must agree with a ``-salient<P>pct`` suffix if both are given. A `QuantScheme`
    passes through (its target must match).
    """
    if target not in ("weights", "activations"):
        raise QuantSchemeError(f"target must be 'weights' or 'activations', not {target!r}")
    if isinstance(spec, QuantScheme):
        if spec.target != target:
            raise QuantSchemeError(f"scheme {spec} targets {spec.target}, not {target}")
        if keep_salient is not None and keep_salient != spec.keep_salient:
            return parse_scheme(str(spec), target, keep_salient=keep_salient)
        return spec
    if not isinstance(spec, str):
        raise _bad(spec, "expected a string")
    text = spec.strip().lower()
    if keep_salient is not None:
        if isinstance(keep_salient, bool) or not isinstance(keep_salient, (int, float)) or not (
            0.0 < keep_salient < 1.0
        ):
            raise _bad(spec, f"keep_salient must be a fraction in (0, 1), got {keep_salient!r}")
        keep_salient = float(keep_salient)

    m = _FP8_RE.match(text)
    if m:
        mods = [mod for mod in m.group("mods").split("-") if mod]
        if len(set(mods)) != len(mods):
            raise _bad(spec, "a modifier is repeated")
        if keep_salient is not None:
            raise _bad(spec, "salient-channel protection applies to INT weight schemes only")
        fmt = str(canonical_format(m.group("fmt"))).removeprefix("fp8-")  # e4m3fn -> e4m3
        return QuantScheme(
            kind="fp8",
            target=target,
            fp8_format=fmt,  # type: ignore[arg-type]
            saturate="nosat" not in mods,
            dynamic_scale="dynamic" in mods,
        )

    m = _INT_RE.match(text)
    if not m:
        raise _bad(spec, "not recognised")
    gran = m.group("gran")
    group_size: int | None = None
    if m.group("gs") is not None:
        group_size = int(m.group("gs"))
        if group_size < 1:
            raise _bad(spec, "the group size must be at least 1")
        gran = "group"
    if gran == "per-channel" and target == "activations":
        raise _bad(spec, "per-channel is a weight granularity; for activations use per-token")
    if gran == "per-token" and target == "weights":
        raise _bad(spec, "per-token is an activation granularity; for weights use per-channel")
    salient = keep_salient
    if m.group("pct") is not None:
        pct = float(m.group("pct"))
        if not 0.0 < pct < 100.0:
            raise _bad(spec, "the salient percentage must be in (0, 100)")
        if keep_salient is not None and abs(keep_salient - pct / 100.0) > 1e-12:
            raise _bad(spec, f"keep_salient={keep_salient} disagrees with salient{pct:g}pct")
        salient = pct / 100.0
    if salient is not None and target != "weights":
        raise _bad(spec, "salient-channel protection applies to weights only")
    return QuantScheme(
        kind="int",
        target=target,
        bits=int(m.group("bits")),
        granularity=gran,  # type: ignore[arg-type]
        group_size=group_size,
        keep_salient=salient,
    )
