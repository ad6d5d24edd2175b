"""Rolling a KV cache back before the guard reruns a failed step.

The rerun must see the cache as it was before the failed pass, or it would attend to the
failed pass's keys/values twice. `rollback` removes what the failed pass appended and returns
None, or returns why it cannot, WITHOUT touching the cache when it can tell beforehand:

- legacy tuple caches: nothing to do (the forward returned a new one; the input is untouched);
- transformers' layered caches (4.5x / 5.x): every layer must be croppable - a sliding-window
  layer that has passed its window has dropped the states a rollback would restore
  (``is_croppable`` False, or ``record_past`` off past the window), as has any layer that says so;
- caches without ``crop`` (4.x ``SlidingWindowCache``, ``HybridCache``, ``StaticCache``,
  ``MambaCache``) cannot be rolled back.

A ``crop`` that raises anyway is caught; the reason then says the cache may hold the failed
pass's states. The guard turns every reason into a ``no_rollback`` incident and switches to
per-module checks (see qforensics.guard.steps).
"""

from __future__ import annotations

from typing import Any

__all__ = ["cache_length", "rollback", "why_not_croppable"]


def cache_length(cache: Any) -> int | None:
    """Tokens in ``cache`` (None when it cannot say)."""
    if cache is None or isinstance(cache, (tuple, list)):
        return None
    fn = getattr(cache, "get_seq_length", None)
    if not callable(fn):
        return None
    try:
        return int(fn())
    except Exception:
        return None


def why_not_croppable(cache: Any) -> str | None:
    """Why removing the last tokens of ``cache`` cannot restore it (None: it can)."""
    kind = type(cache).__name__
    if not callable(getattr(cache, "crop", None)):
        return f"the KV cache ({kind}) has no crop(): it cannot be rolled back"
    for i, layer in enumerate(getattr(cache, "layers", None) or ()):
        lk = type(layer).__name__
        croppable = getattr(layer, "is_croppable", True)
        if croppable is False:
            return (f"the KV cache ({kind}) cannot be rolled back: layer {i} ({lk}) has "
                    "already evicted the states a rollback would restore")
        window = getattr(layer, "sliding_window", None)
        if isinstance(window, int) and getattr(layer, "is_sliding", False) and \
                not getattr(layer, "record_past", True):
            try:
                seen = int(layer.get_seq_length())
            except Exception:
                seen = window
            if seen >= window:
                return (f"the KV cache ({kind}) cannot be rolled back: sliding-window layer {i} "
                        f"({lk}, window {window}) is full and does not record past states")
    return None


def rollback(cache: Any, length: int | None) -> str | None:
    """Crop ``cache`` back to ``length`` tokens; None when done, else why not."""
    if cache is None or isinstance(cache, (tuple, list)):
        return None
    kind = type(cache).__name__
    if length is None:
        return f"the KV cache ({kind}) cannot say its length: it cannot be rolled back"
    why = why_not_croppable(cache)
    if why:
        return why
    now = cache_length(cache)
    if now is None:
        return f"the KV cache ({kind}) cannot say its length: it cannot be rolled back"
    added = now - length
    if added < 0:
        return f"the KV cache ({kind}) shrank during the step: it cannot be rolled back"
    try:
        if added > 0:
            cache.crop(-added)  # negative: remove that many tokens (transformers 4.x and 5.x)
    except Exception as exc:
        return (f"rolling back the KV cache ({kind}) raised {type(exc).__name__}: {exc}; it may "
                "still hold the failed pass's states")
    if cache_length(cache) != length:
        return f"rolling back the KV cache ({kind}) failed"
    return None
