"""`qforensics report TRACE -o incident.html`: the self-contained HTML incident report.

Only printing and exit codes live here; the report itself is `qforensics.reports`.
Exit codes: 0 the report was written (whatever the verdict), 2 unreadable input or bad options,
3 internal error.
"""

from __future__ import annotations

from pathlib import Path

import click

EXAMPLE = """\b
Example:
    qforensics report trace.h5 -o incident.html
    qforensics report trace.h5 -o incident.html --reference ref.h5
    qforensics report trace.h5 -o incident.html --replay replay.json
    qforensics report trace.h5 -o incident.html --whatif whatif.json
"""


@click.command(
    "report",
    help="Write a self-contained HTML incident report for TRACE: verdict, causal chain, "
         "plots, outlier channels, predicted damage per scheme, environment, module health "
         "and recommendations with the commands that verify them. The file loads nothing "
         "from the network; open it offline or attach it to a ticket.\n\n"
         "Prints the report path and the verdict line; exits 0 when the report is written "
         "(whatever the verdict), 2 when an input cannot be read, 3 on an internal error.",
    epilog=EXAMPLE,
)
@click.argument("trace", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", "output", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="HTML file to write [default: TRACE with .html].")
@click.option("--reference", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="A trace of the same prompt from a reference (e.g. FP16) run: adds "
                   "divergence per module.")
@click.option("--replay", "replay", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="A result of `qforensics replay --json`: adds its verdict.")
@click.option("--whatif", "whatif", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="A result of `qforensics whatif --json` (with --target): "
                                 "adds its table of schemes (quality, memory, speed against "
                                 "bf16) and recommendation to the Recommendations.")
def command(trace: Path, output: Path | None, reference: Path | None,
            replay: Path | None, whatif: Path | None) -> None:
    from qforensics.reports import write_report

    out = output if output is not None else trace.with_suffix(".html")
    result = write_report(trace, out, reference=reference, replay=replay, whatif=whatif)
    click.echo(f"wrote {result.path} ({result.bytes / 1024:.0f} KiB)")
    click.echo(result.verdict.line)
