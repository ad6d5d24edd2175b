"""Capture side: forward hooks that hand each tensor to one stats op, which reduces it on its
device into a ring, and stream the records to a trace.

Use `qforensics.capture(model, path)`; the implementation lives in `qforensics.hooks.session`
(the session), `graphhooks` / `graphmode` / `graphlate` (the hooks, the ring's reading), the
op (`statsop`, `statscpu`, `statstriton`), `snapshots` and `registry`.
"""
