"""`qforensics analyze TRACE...`: print the findings of one or more traces (printing and exit
codes only; the analysis lives in qforensics.analyze). No torch import."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from typing import Any

import click

from qforensics.analyze import analyze_trace, analyze_traces
from qforensics.analyze.findings import Findings, MultiRankFindings
from qforensics.analyze.thresholds import Thresholds
from qforensics.cli.jsonout import JsonCommand, json_option, json_out
from qforensics.cli.text import WIDTH, figure, wrap
from qforensics.errors import UsageError

_D = Thresholds()


def threshold_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The analyzer thresholds as click options (shared by analyze and report)."""
    opts = [
        click.option("--top", type=click.IntRange(1, 10000), default=_D.top, show_default=True,
                     help="Outlier channels, modules per scheme and items listed."),
        click.option("--ratio", type=click.FloatRange(0), default=_D.ratio, show_default=True,
                     help="A channel stands out at this multiple of its module's median "
                          "channel absmax."),
        click.option("--absolute", type=click.FloatRange(0), default=_D.absolute,
                     show_default=True, help="A channel stands out at this absmax on its own."),
        click.option("--unsafe-fraction", type=click.FloatRange(0, 1),
                     default=_D.unsafe_fraction, show_default=True,
                     help="A scheme is unsafe for a module when it zeroes this share of its "
                          "input channels (or anything overflows)."),
        click.option("--persistent-min", "persistent_min_modules", type=click.IntRange(1),
                     default=_D.persistent_min_modules, show_default=True,
                     help="A hidden dim standing out in this many modules is persistent."),
        click.option("--repeat-tokens", type=click.IntRange(2), default=_D.repeat_tokens,
                     show_default=True,
                     help="The same argmax (or a cycle of up to 4) this many times is a loop."),
        click.option("--logits-extreme", type=click.FloatRange(0), default=_D.logits_extreme,
                     show_default=True, help="A max |logit| that looks broken on its own."),
        click.option("--logits-growth-factor", type=click.FloatRange(1),
                     default=_D.logits_growth_factor, show_default=True,
                     help="Growth of max |logit| over consecutive rising steps that counts."),
        click.option("--agreement-min", type=click.FloatRange(0, 1), default=_D.agreement_min,
                     show_default=True,
                     help="Top-1 agreement with the reference (outcome metadata) below this "
                          "is suspect."),
        click.option("--param-zero-share", type=click.FloatRange(0, 1),
                     default=_D.param_zero_share, show_default=True,
                     help="A weight with more than this share of exact zeros is suspect."),
        click.option("--param-levels", type=click.FloatRange(0), default=_D.param_levels,
                     show_default=True,
                     help="A weight whose median group holds at most this many distinct values "
                          "is suspect (raise it for ternary models only if you must)."),
        click.option("--static-overrun", type=click.FloatRange(1), default=_D.static_overrun,
                     show_default=True,
                     help="A recorded input this many times beyond a static input_scale's range "
                          "is suspect."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def expand_paths(paths: tuple[str, ...]) -> list[str]:
    """Shell globs arrive expanded; quoted ones ('trace-*.h5') are expanded here."""
    out: list[str] = []
    for p in paths:
        if not os.path.exists(p) and any(c in p for c in "*?["):
            hits = sorted(glob.glob(p))
            if not hits:
                raise UsageError(f"no trace matches {p!r}")
            out.extend(hits)
        else:
            out.append(p)
    return out


# -- rendering -------------------------------------------------------------------------------------
def render(f: Findings) -> list[str]:
    """Plain-text report of one trace, at most 100 columns (long module names aside)."""
    L: list[str] = [f.verdict.line]
    env = f.environment
    bits = [f"{k} {env[k]}" for k in ("model_class", "torch") if env.get(k)]
    if env.get("dtypes"):
        bits.append("dtypes " + ",".join(map(str, env["dtypes"])))
    if env.get("devices"):
        bits.append("devices " + ",".join(map(str, env["devices"])))
    L.append(wrap(f"trace {f.trace}: rank {f.rank} of {f.world_size}, {f.n_steps} steps, "
                  f"{f.n_modules} modules; {f.end.reason}", "", "    "))
    if bits:
        L.append(wrap("environment: " + "; ".join(bits), "", "    "))
    oc = env.get("outcome")
    if isinstance(oc, dict) and oc.get("scenario"):
        L.append(wrap(f"scenario: {oc.get('scenario')} (weights {oc.get('weights')}, "
                      f"activations {oc.get('activations')})", "", "    "))

    fn = f.first_nonfinite
    if fn is not None:
        L += ["", "First non-finite value"]
        L.append(wrap(f"step {fn.step}, call {fn.call_index}: {fn.module} ({fn.module_kind}), "
                      f"{fn.tensor} {fn.slot}: {fn.nan_count:,} NaN, {fn.inf_count:,} Inf of "
                      f"{fn.numel:,} values"))
        if fn.producer_module is not None:
            rng = (f"[{figure(fn.input_min)}, {figure(fn.input_max)}], absmax "
                   f"{figure(fn.input_absmax)}" if fn.input_absmax is not None else "not recorded")
            L.append(wrap(f"producer: {fn.module} - its input is finite (range {rng}), its "
                          "output is not"))
        else:
            L.append(wrap(f"producer: an unhooked op - {fn.producer.description}"))  # type: ignore
        sp = fn.spread
        L.append(wrap(f"spread: {sp.n_modules} of {sp.n_modules_total} modules and "
                      f"{sp.n_steps} of {sp.n_steps_after} steps from step {fn.step} on hold "
                      f"NaN/Inf ({sp.n_records:,} records in step {fn.step}); logits "
                      f"non-finite in {sp.logits_nonfinite_steps} steps"))

    if f.cause is not None:
        L += ["", "Cause"]
        L.append(wrap(f.cause.line.removeprefix("cause: ")))
    nl = f.nonfinite_logits
    if nl is not None:
        per = (f"{nl.per_row:,} per row" if nl.per_row is not None else
               f"{nl.last_row_count:,} at the last position of row 0")
        ids = (", ".join(map(str, nl.vocab_ids[:12])) + (" ..." if nl.n_vocab_ids > 12 else "")
               if nl.n_vocab_ids < nl.vocab else "all of them")
        L += ["", f"Non-finite logits (step {nl.step})"]
        L.append(wrap(f"{nl.nan_count:,} NaN, {nl.inf_count:,} Inf over {nl.rows} row"
                      f"{'' if nl.rows == 1 else 's'} x "
                      f"{nl.vocab:,} vocab ids ({per}); vocab ids with no finite logit: "
                      f"{nl.n_vocab_ids:,} ({ids}); {nl.symptom}"))
    if f.evidence:
        title = "Evidence" if fn is None else "Evidence besides the failure"
        L += ["", title + " (thresholds and why: --json)"]
        for e in f.evidence:
            L.append(wrap(f"{e.source}: {e.line}"))
    if f.reference is not None:
        r = f.reference
        L += ["", "Against the reference"]
        L.append(wrap(r.line))
        if r.per_layer:
            L.append(wrap("error per layer: " + " ".join(
                f"{x['layer'].rsplit('.', 1)[-1]}:{figure(x['score'])}" for x in r.per_layer)))
    if f.outliers:
        where = (f"input of {f.first_nonfinite.module}" if fn is not None and
                 fn.producer_module is not None else "module inputs with the largest ratios")
        L += ["", f"Outlier channels ({where}, step {f.outlier_step})"]
        L.append(f"  {'channel':>7}  {'absmax':>10}  {'x median':>9}  {'token':>5}  "
                 f"{'first':>5}  limits / trend")
        prev = None
        for o in f.outliers:
            tr = " ".join(f"{p.step}:{figure(p.absmax)}" for p in o.trend[-6:])
            tok = "-" if o.token is None else str(o.token)
            first = "-" if o.first_step is None else str(o.first_step)
            if (fn is None or fn.producer_module is None) and o.module != prev:
                L.append(f"  {o.module}")
            prev = o.module
            L.append(f"  {o.channel:>7}  {figure(o.absmax):>10}  {figure(o.ratio_to_median):>9}  "
                     f"{tok:>5}  {first:>5}  {','.join(o.limits)}"
                     + (f"; steps {tr}" if len(o.trend) > 1 else ""))
        L.append("  (token: the record's peak token, argmax of its per-token absmax; first: "
                 "first step it stood out)")
    if f.persistent:
        L += ["", f"Persistent outlier dims (step {f.outlier_step})"]
        for p in f.persistent:
            L.append(wrap(f"dim {p.dim}: stands out in {p.modules} of {p.modules_checked} "
                          f"module inputs (max absmax {figure(p.max_absmax)}, "
                          f"{figure(p.max_ratio)}x median), e.g. {', '.join(p.examples)}"))
    if f.unsafe:
        n_mod = f.unsafe[0].n_modules
        L += ["", f"Predicted damage to linear inputs (step {f.damage_step}, {n_mod} modules)"]
        shown = 3
        for u in f.unsafe:
            L.append(wrap(u.line))
            for d in u.modules[:shown]:
                L.append(wrap(f"{d.module}: {d.line}", "      ", "        "))
    if f.precursors:
        title = "Precursors" if fn is not None else "Silent failure signs"
        L += ["", title]
        for p in f.precursors:
            L.append(wrap(f"{p.kind}: {p.line}"))
    if f.snapshots:
        L += ["", "Snapshots (for `qforensics replay`)"]
        for s in f.snapshots:
            L.append(wrap(f"call {s.call_index} (step {s.step}, {s.reason}): {s.module}: "
                          f"{', '.join(s.names)}"))
    if f.incidents:
        from collections import Counter

        counts = Counter(i.action for i in f.incidents)
        L += ["", f"Runtime guard incidents ({len(f.incidents)}: "
              + ", ".join(f"{a} {n}" for a, n in sorted(counts.items())) + ")"]
        for i in f.incidents[:10]:
            L.append(wrap(f"step {i.step}: {i.action} {i.module} ({i.nan_count} NaN, "
                          f"{i.inf_count} Inf): {i.detail}"))
        if len(f.incidents) > 10:
            L.append(f"  ... {len(f.incidents) - 10} more (--json lists all)")
    if f.notes:
        L += ["", "Notes"]
        for n in f.notes:
            L.append(wrap(n))
    return L


def render_multi(m: MultiRankFindings) -> list[str]:
    L = [m.verdict.line]
    for f in m.ranks:
        L.append(wrap(f"rank {f.rank}: {f.verdict.line}", "  ", "      "))
    for f in m.ranks:
        L += ["", f"== rank {f.rank}: {f.trace} " + "=" * max(0, WIDTH - 14 - len(f.trace))]
        L += render(f)
    return L


EXAMPLE = """\b
Example:
    qforensics analyze trace.h5
    qforensics analyze trace-*.h5 --json out.json
    qforensics analyze trace.h5 --json > findings.json
    qforensics analyze trace.h5 --json=findings.txt
    qforensics analyze trace.h5 --ratio 50 --top 20
    qforensics analyze int4.h5 --reference fp16.h5
"""


@click.command("analyze", cls=JsonCommand, epilog=EXAMPLE)
@click.argument("traces", nargs=-1, required=True)
@json_option("the findings (schema qforensics.analyze, docs/analyze-json.md)")
@click.option("--reference", type=click.Path(dir_okay=False), default=None,
              help="A trace of the same prompt from a reference (e.g. unquantized) run: adds the "
                   "first diverging module, the error per layer and whether it starts at the "
                   "quantized layers (one trace only).")
@threshold_options
def command(traces: tuple[str, ...], json_path: str | None, reference: str | None,
            **thresholds: Any) -> None:
    """Find the first NaN/Inf in a trace, the module (or unhooked op) that produced it, the
    outlier channels responsible and the damage each quantization scheme would do.

    TRACES are trace files written by `qforensics record` / `qforensics.capture`; several (one
    per rank) are analyzed together and the earliest failure across ranks is named. A trace
    left behind by a crashed run is analyzed as far as it goes. Torch is not needed.

    Exit status: 0 PASSED, 1 FAILED or SUSPECT, 2 bad usage or unreadable trace, 3 internal
    error.
    """
    paths = expand_paths(traces)
    out = json_out(json_path, [*paths, reference])
    if reference is not None and len(paths) != 1:
        raise UsageError("--reference compares one trace; give exactly one TRACE with it")
    if len(paths) == 1:
        one = analyze_trace(paths[0], reference=reference, **thresholds)
        doc, text, code = one.to_dict(), render(one), one.exit_code
    else:
        many = analyze_traces(paths, **thresholds)
        doc, text, code = many.to_dict(), render_multi(many), many.exit_code
    out.text("\n".join(text))
    out.write(doc)
    click.get_current_context().exit(code)
