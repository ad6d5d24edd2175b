"""HDF5 trace: schema, crash-safe writer, validating reader. No torch import."""

from qforensics.trace.reader import Trace, open_trace

__all__ = ["Trace", "open_trace"]
