"""Capture side: forward hooks that reduce tensors on their device and stream stats to a trace."""

from qforensics.hooks.capture import Capture, capture

__all__ = ["Capture", "capture"]
