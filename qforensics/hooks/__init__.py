"""Capture side: forward hooks that reduce tensors on their device and stream stats to a trace.

Use `qforensics.capture(model, path)`; the implementation lives in `qforensics.hooks.session`
(the session and its hooks), `reduce`, `assemble`, `snapshots` and `registry`.
"""
