"""Fallbacks for quantized weight layouts (filled in by the per-layer fallback work)."""

from __future__ import annotations

from qforensics.guard.fallbacks import Fallback

QUANTIZED_FALLBACKS: list[type[Fallback]] = []
