"""`qforensics replay`: rerun the suspect GEMM tile under compute-sanitizer, or emulate it on CPU."""

from __future__ import annotations

import click

from qforensics.replay.run import replay
from qforensics.replay.sanitizer import DEFAULT_PRINT_LIMIT, TOOLS
from qforensics.replay.verdict import write_result_json

EXAMPLE = """\b
Example:
    qforensics replay trace.h5 --bundle-out call17.h5 --json replay.json
    qforensics replay call17.h5 --tool initcheck --sanitizer /opt/cuda/bin/compute-sanitizer
    qforensics replay call17.h5 --launcher my_awq_ext.replay:launch --gpu
"""


@click.command(name="replay", epilog=EXAMPLE)
@click.argument("source", metavar="TRACE_OR_BUNDLE", type=click.Path(dir_okay=False))
@click.option("--call", type=int, default=None, help="Snapshot call index (default: first non-finite, else first outlier).")
@click.option("--bundle-out", type=click.Path(dir_okay=False), default=None, help="Write the replay bundle here.")
@click.option("--tool", type=click.Choice(TOOLS), default="memcheck", show_default=True, help="compute-sanitizer tool.")
@click.option("--sanitizer", type=click.Path(dir_okay=False), default=None,
              help="compute-sanitizer executable (default: PATH, then the nvidia-cuda-sanitizer-api wheel).")
@click.option("--launcher", default=None, metavar="MOD:FN",
              help="Run your own op instead: MOD:FN receives (tensors: dict of numpy arrays, meta: dict).")
@click.option("--emulate/--gpu", "mode", default=None,
              help="--emulate: CPU emulation only; --gpu: GPU only. Default: GPU when present, emulation always.")
@click.option("--kernel-name", default=None, help="Sanitizer kernel filter (default for the project kernel: kns=qf_awq_gemm).")
@click.option("--print-limit", type=int, default=DEFAULT_PRINT_LIMIT, show_default=True, help="Sanitizer --print-limit.")
@click.option("--arch", default=None, help="nvcc arch for the project kernel, e.g. sm_90 (default: from nvidia-smi).")
@click.option("--work-dir", type=click.Path(file_okay=False), default=None,
              help="Keep kernel inputs and the raw sanitizer output here (default: a temp dir).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help="Write the result as JSON.")
def command(source: str, call: int | None, bundle_out: str | None, tool: str, sanitizer: str | None,
            launcher: str | None, mode: bool | None, kernel_name: str | None, print_limit: int, arch: str | None,
            work_dir: str | None, json_out: str | None) -> None:
    """Replay the suspect GEMM call of TRACE_OR_BUNDLE and say what it measured.

    \b
    Each line starts with a verdict:
      CONFIRMED       compute-sanitizer reported an invalid access (the first one is named)
      NOT REPRODUCED  0 errors and the kernel ran on this tile
      INCONCLUSIVE    nothing was measured, and why (no GPU, no sanitizer, ...)
      EMULATED        the CPU emulation of the project kernel's index arithmetic
    Exit codes: 0 clean, 1 CONFIRMED or emulation errors, 2 bad usage or
    unreadable input, 3 only INCONCLUSIVE results.
    """
    m = {None: "auto", True: "emulate", False: "gpu"}[mode]
    outcome = replay(source, call=call, bundle_out=bundle_out, mode=m, tool=tool, sanitizer=sanitizer,
                     launcher=launcher, kernel_name=kernel_name, print_limit=print_limit, arch=arch, work_dir=work_dir)
    for res in outcome.results:
        click.echo(res.line())
        raw = (res.details.get("sanitizer") or {}).get("raw_output") if res.details else None
        if raw:
            click.echo(f"  raw sanitizer output: {raw}")
    if outcome.bundle.path is not None:
        click.echo(f"  bundle: {outcome.bundle.path}")
    if json_out:
        write_result_json(outcome.document(), json_out)
        click.echo(f"  json: {json_out}")
    ctx = click.get_current_context()
    ctx.exit(outcome.exit_code())
