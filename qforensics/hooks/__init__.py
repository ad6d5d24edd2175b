"""Capture side: forward hooks that reduce tensors on their device and stream stats to a trace.

Use `qforensics.capture(model, path)`; the implementation lives in `qforensics.hooks.capture`.
"""
