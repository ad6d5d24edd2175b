"""User-facing errors of the fake-quant package (subclasses of `QForensicsError`).

The CLI prints these as one line without a traceback, so each message says what is wrong and
how to fix it.
"""

from __future__ import annotations

from qforensics.errors import QForensicsError, UsageError

__all__ = ["QuantApplyError", "QuantSchemeError"]


class QuantSchemeError(UsageError, ValueError):
    """A quantization scheme string or argument is invalid (bad spec, bits, group size)."""


class QuantApplyError(QForensicsError):
    """A valid scheme cannot be applied to this model (nothing to quantize, missing stats)."""
