"""Option decorators shared by several commands (capture options for `record` and `demo`)."""

from __future__ import annotations

from typing import Any, Callable

import click

from qforensics.formats import E4M3_MAX
from qforensics.trace.budgetopts import DEFAULT_MAX_BYTES, max_bytes_from_env

F = Callable[..., Any]


def capture_options(f: F) -> F:
    opts = [
        click.option("--flush-interval", type=float, default=1.0, show_default=True,
                     help="Seconds between trace flushes (what a SIGKILL can lose)."),
        click.option("--channel-dtype", type=click.Choice(["float32", "float16"]),
                     default="float32", show_default=True,
                     help="Storage type of per-channel min/max."),
        click.option("--channel-steps", default="auto", show_default=True,
                     help='Steps whose per-channel ranges are stored: "auto" (the prefill, '
                          'the last --ring-steps steps, triggered steps and the 8 before '
                          'them), "all", "none" or ranges like "0-3,8".'),
        click.option("--ring-steps", type=click.IntRange(1, 4096), default=16,
                     show_default=True,
                     help="Steps in the rolling window of per-channel ranges (auto mode)."),
        click.option("--max-bytes-mib", type=click.FloatRange(min=0), default=None,
                     help="The trace's byte budget for a run of any length (0: none); "
                          "default: QFORENSICS_MAX_BYTES (e.g. 1G), else 1024."),
        click.option("--modules", "modules_spec", default="default", show_default=True,
                     help='"default" (linears, decoder blocks, logits) or "linear".'),
        click.option("--snapshot-budget-mib", type=float, default=64.0, show_default=True,
                     help="Bytes of full tensors kept for the calls that matter."),
        click.option("--outlier-threshold", type=float, default=E4M3_MAX, show_default=True,
                     help="Linear input absmax that triggers the outlier snapshot."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def capture_kwargs(flush_interval: float, channel_dtype: str, channel_steps: str,
                   modules_spec: str, snapshot_budget_mib: float, outlier_threshold: float,
                   ring_steps: int = 16, max_bytes_mib: float | None = None) -> dict[str, Any]:
    if flush_interval <= 0:
        raise click.BadParameter("must be positive", param_hint="--flush-interval")
    if max_bytes_mib is not None:
        max_bytes: int | None = int(max_bytes_mib * (1 << 20))
    else:
        try:
            max_bytes = max_bytes_from_env()
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="QFORENSICS_MAX_BYTES") from None
        max_bytes = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    return {
        "flush_interval": flush_interval,
        "channel_dtype": channel_dtype,
        "channel_steps": channel_steps,
        "modules": modules_spec,
        "snapshot_budget": int(snapshot_budget_mib * (1 << 20)),
        "outlier_threshold": outlier_threshold,
        "ring_steps": ring_steps,
        "trigger_window": min(8, ring_steps),
        "max_bytes": max_bytes or None,
    }
