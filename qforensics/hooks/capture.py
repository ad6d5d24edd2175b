"""`qforensics.capture(model, "trace.h5")`: the public entry point of the capture side.

The implementation is split along its seams: `session` (the Capture session and its hooks),
`reduce` (device reductions), `assemble` (host assembly into step batches), `snapshots` (full
tensors of the calls that matter) and `registry` (which model is captured; exit and signal
flushing); `plan` (step plans: the hook-time work of repeated steps) and `recorder` (which
steps keep channels). This module holds the `capture` factory.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from qforensics.hooks.registry import active_capture
from qforensics.hooks.session import Capture

__all__ = ["Capture", "active_capture", "capture"]


def capture(model: nn.Module, path: str | os.PathLike[str] = "trace.h5", **options: Any
            ) -> Capture:
    """Capture per-call statistics of `model` into an HDF5 trace at `path`.

    >>> with qforensics.capture(model, "trace.h5"):       # doctest: +SKIP
    ...     model.generate(input_ids, max_new_tokens=64)

    Options: modules (None | "linear" | names | callable), flush_interval (s, default 1),
    channel_dtype ("float32" | "float16"), channel_limit (widest last dim whose per-channel
    ranges are stored, default 8192), channel_steps ("auto" | "all" | "none" | "0-3,8" |
    callable; "auto", the default, is the flight recorder: per-channel ranges of the prefill, of
    the last ring_steps steps (default 16, in memory and in a fixed-size circular region of the
    file) and of every step that crosses a trigger plus the trigger_window steps before it
    (default 8; at most trigger_limit=32 triggered steps; triggers: non-finite values, GEMM-input
    or logits absmax growing past outlier_growth=4 x the recent median)), max_bytes (the file's
    byte budget for a run of any length, default 1 GiB (`record` and the vLLM plugin also read
    QFORENSICS_MAX_BYTES); near it, old
    steps' summaries are consolidated into coarser blocks, never dropped, while the ring and
    the pinned first failure keep their detail; 0 or None: no budget), channel_io ("all" |
    "inputs" | "none"), snapshot_budget (bytes, default 64 MiB),
    snapshot_tile_rows (weight rows kept around the first bad output, default 256),
    outlier_threshold (absmax that triggers the outlier snapshot, default 448), compiled (None:
    told from the model and the engine; False: the model runs eagerly, its modules may run
    more than once a step), param_watch (steps between two
    checks of the weights and scales for NaN/Inf during the run, default 256, also run at the
    first non-finite step and at close; 0: checked at attach only), metadata (dict recorded in the
    environment), rank / world_size (default from RANK / WORLD_SIZE). A path with "{rank}", or
    any path when world_size > 1, gives one file per rank.
    """
    return Capture(model, path, **options)
