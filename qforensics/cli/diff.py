"""`qforensics diff REFERENCE SUSPECT`: where two captures of the same prompt diverge (printing and
exit codes only; the comparison lives in qforensics.analyze.diff). No torch import."""

from __future__ import annotations

import click

from qforensics.analyze.diff import DEFAULT_JUMP, diff_traces
from qforensics.analyze.findings import DiffFindings
from qforensics.cli.jsonout import JsonCommand, json_option, json_out
from qforensics.cli.text import figure, wrap

EXAMPLE = """\b
Example:
    qforensics diff fp16-reference.h5 int4-per-tensor-weights.h5
    qforensics diff ref.h5 suspect.h5 --steps 0,1 --json > diff.json
    qforensics diff ref.h5 suspect.h5 --json diff.json
"""


def render_diff(d: DiffFindings) -> list[str]:
    L = [d.verdict.line,
         wrap(f"reference {d.reference} vs suspect {d.suspect}: {d.n_aligned:,} records aligned "
              f"by (module, step, io, slot) in steps {', '.join(map(str, d.steps_compared))}; "
              f"{d.n_only_reference:,} only in the reference, {d.n_only_suspect:,} only in the "
              "suspect", "", "    ")]
    if d.ranked:
        L += ["", "Modules ranked by the divergence they add (output score - input score)"]
        L.append(f"  {'step':>4}  {'call':>6}  {'adds':>7}  {'score':>7}  {'std err':>7}  "
                 f"{'chan div':>8}  {'SQNR dB':>7}  module")
        for r in d.ranked:
            L.append(f"  {r.step:>4}  {r.call_index:>6}  {figure(r.jump):>7}  "
                     f"{figure(r.score):>7}  {figure(r.rel_std):>7}  {figure(r.channel_div):>8}  "
                     f"{figure(r.sqnr_db):>7}  "
                     f"{r.module}" + ("  (NaN/Inf)" if r.nonfinite else ""))
    for n in d.notes:
        L.append(wrap(f"note: {n}", "", "    "))
    return L


@click.command("diff", cls=JsonCommand, epilog=EXAMPLE)
@click.argument("reference", type=click.Path(exists=True, dir_okay=False))
@click.argument("suspect", type=click.Path(exists=True, dir_okay=False))
@json_option("the comparison (schema qforensics.diff, docs/analyze-json.md)")
@click.option("--top", type=click.IntRange(1, 10000), default=10, show_default=True,
              help="Modules listed in the ranking.")
@click.option("--jump", type=click.FloatRange(0), default=DEFAULT_JUMP, show_default=True,
              help="Divergence a module must add (output score - input score) to count as "
                   "where divergence jumps.")
@click.option("--steps", default=None, metavar="0,1,...",
              help="Steps to compare. Default: the prefill (step 0), and it alone.")
def command(reference: str, suspect: str, json_path: str | None, top: int, jump: float,
            steps: str | None) -> None:
    """Compare two captures of the same prompt (e.g. FP16 reference vs INT4) and name the first
    module, in call order, where the divergence jumps, with a ranked list.

    Records are aligned by (module, step, io, slot); divergence is the relative error of the
    recorded std / absmax / mean, the per-channel range divergence where both traces stored
    ranges, and SQNR / cosine of snapshot tensors both traces kept.

    Exit status: 0 no jump, 1 a jump or NaN/Inf only in the suspect, 2 bad usage or unreadable
    trace, 3 internal error.
    """
    out = json_out(json_path, [reference, suspect])
    chosen = None
    if steps:
        try:
            chosen = [int(s) for s in steps.split(",") if s.strip()]
        except ValueError:
            raise click.BadParameter("a comma-separated list of step numbers", param_hint="--steps")
    d = diff_traces(reference, suspect, jump=jump, top=top, steps=chosen)
    out.text("\n".join(render_diff(d)))
    out.write(d.to_dict())
    click.get_current_context().exit(d.exit_code)
