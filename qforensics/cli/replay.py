"""`qforensics replay`: rerun the suspect GEMM tile through the kernel the run used and judge it."""

from __future__ import annotations

import click

from qforensics.cli.jsonout import JsonCommand, json_option, json_out
from qforensics.replay.run import replay
from qforensics.replay.sanitizer import DEFAULT_PRINT_LIMIT, TOOLS
from qforensics.replay.torch_kernels import KERNELS

EXAMPLE = """\b
Example:
    qforensics replay trace.h5 --json replay.json --export repro/
    qforensics replay trace.h5 --json | jq .results
    qforensics replay trace.h5 --kernel torch-int4pack
    qforensics replay call17.h5 --launcher my_awq_ext.replay:launch --sanitize on
"""


@click.command(name="replay", cls=JsonCommand, epilog=EXAMPLE)
@click.argument("source", metavar="TRACE_OR_BUNDLE", type=click.Path(dir_okay=False))
@click.option("--call", type=int, default=None, help="Snapshot call index (default: first non-finite, else first outlier).")
@click.option("--kernel", type=click.Choice(sorted(KERNELS)), default=None,
              help="Judge this torch kernel on the recorded data (default: the kernel the trace says the run used).")
@click.option("--launcher", default=None, metavar="MOD:FN",
              help="Judge your own op: MOD:FN receives (tensors: dict of numpy arrays, meta: dict) and returns y [M, N].")
@click.option("--sanitize", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="compute-sanitizer leg: auto = when a GPU is present; it needs one to measure anything.")
@click.option("--tool", type=click.Choice(TOOLS), default="memcheck", show_default=True, help="compute-sanitizer tool.")
@click.option("--sanitizer", type=click.Path(dir_okay=False), default=None,
              help="compute-sanitizer executable (default: PATH, then the nvidia-cuda-sanitizer-api wheel).")
@click.option("--kernel-name", default=None, help="Sanitizer kernel filter, e.g. kns=gemm.")
@click.option("--print-limit", type=int, default=DEFAULT_PRINT_LIMIT, show_default=True, help="Sanitizer --print-limit.")
@click.option("--bundle-out", type=click.Path(dir_okay=False), default=None, help="Keep the replay bundle here.")
@click.option("--work-dir", type=click.Path(file_okay=False), default=None,
              help="Keep launcher output and raw sanitizer output here (default: a temp dir, removed afterwards).")
@click.option("--export", "export_dir", type=click.Path(file_okay=False), default=None,
              help="Write a repro for an upstream bug report: tensors (safetensors), geometry JSON, script.")
@json_option("the result (schema qforensics.replay, docs/replay.md; what `report --replay` reads)")
def command(source: str, call: int | None, kernel: str | None, launcher: str | None, sanitize: str, tool: str,
            sanitizer: str | None, kernel_name: str | None, print_limit: int, bundle_out: str | None,
            work_dir: str | None, export_dir: str | None, json_path: str | None) -> None:
    """Rerun the suspect GEMM call of TRACE_OR_BUNDLE through the kernel the run used, on the
    data it saw, against a float64 reference.

    \b
    Each line starts with a verdict:
      KERNEL FAULT     compute-sanitizer saw an illegal access by the kernel (GPU only)
      KERNEL DIVERGES  the reference is finite; the kernel's output is not, or is beyond tolerance
      DATA             the kernel agrees with the reference, which is itself non-finite:
                       the recorded inputs or parameters make the NaN (named)
      NOT REPRODUCED   the kernel ran on the recorded data and the failure did not recur
      INCONCLUSIVE     nothing was measured, and why (no GPU, kernel not callable here, ...)
    Exit codes: 0 measured and NOT REPRODUCED, 1 KERNEL FAULT / KERNEL DIVERGES / DATA
    or nothing measured, 2 bad usage or unreadable input.
    """
    out = json_out(json_path, [source, bundle_out])
    outcome = replay(source, call=call, bundle_out=bundle_out, kernel=kernel, launcher=launcher, sanitize=sanitize,
                     tool=tool, sanitizer=sanitizer, kernel_name=kernel_name, print_limit=print_limit, work_dir=work_dir)
    meta = outcome.bundle.meta
    out.text(f"call {meta.get('call_index')} {meta.get('module')} ({meta.get('module_type') or '?'}), layout "
             f"{meta.get('layout')}, kernel {kernel or launcher or meta.get('kernel') or 'unknown'}, "
             f"M={meta['M']} of {meta.get('M_full')} N={meta['N']} of {meta.get('N_full')} K={meta['K']}")
    if meta.get("fixture"):
        out.text("  note: this layer is qforensics's own fake-quant FIXTURE; the verdict is about it, not a user kernel")
    for res in outcome.results:
        out.text(res.line())
        raw = (res.details.get("sanitizer") or {}).get("raw_output") if res.details else None
        if raw and work_dir:
            out.note(f"  raw sanitizer output: {raw}")
    if outcome.bundle.path is not None:
        out.note(f"  bundle: {outcome.bundle.path}")
    if export_dir:
        from qforensics.replay.export import export_repro

        where = export_repro(outcome.bundle, export_dir, kernel=kernel or meta.get("kernel"), results=outcome.results)
        out.note(f"  repro: {where} (python {where}/repro.py)")
    out.write(outcome.document())
    click.get_current_context().exit(outcome.exit_code())
