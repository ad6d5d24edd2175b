"""`qforensics whatif`: rerun a trace's prompt under other quantization schemes."""

from __future__ import annotations

import math

import click

from qforensics.cli.jsonout import JsonCommand, json_option, json_out
from qforensics.errors import UsageError
from qforensics.jsondoc import document


@click.command("whatif", cls=JsonCommand)
@click.argument("trace", type=click.Path(dir_okay=False))
@click.option("--scheme", "schemes", multiple=True, metavar="SPEC",
              help="Scheme to try (repeatable): int4-g128, w:int4-per-tensor, "
                   "act:fp8-e4m3-nosat, w:int4-g128+act:int8-per-token. Bare fp8-* and "
                   "*-per-token specs are activations, other INT specs weights. "
                   "ct:PRESET[-g<N>] (ct:W4A16, ct:W4A16-g64, ct:W8A8, ct:FP8_DYNAMIC) runs "
                   "compressed-tensors' own preset through the library (-g<N>: its group "
                   "size). awq:w4a16[-g<N>] (default g128) is AWQ W4A16 in its published "
                   "format. llmc:GPTQ-PRESET[-g<N>] (llmc:GPTQ-W4A16-g64) and llmc:SQ-W8A8 "
                   "(SmoothQuant + GPTQ) are calibrated by llmcompressor in its own venv "
                   "(--llmc-python) and shown next to the ct: twin with min/max scales. All "
                   "three are also measured through vLLM with --engine vllm.")
@click.option("--keep-salient", metavar="PCT",
              help="Keep this share of input channels (by the trace's recorded activation "
                   "absmax) in FP16 for the INT weight schemes of --scheme: 1% or 0.01.")
@click.option("--table", is_flag=True,
              help="Run the scenario schemes (int4-per-tensor, int4-g128, "
                   "int4-g128-salient1pct weights; int8-per-tensor, fp8-e4m3-nosat, fp8-e4m3 "
                   "activations) and print a table.")
@click.option("--model", "model_spec", metavar="MODEL",
              help="The model to rerun: an HF folder, a .gguf file, module:factory (a callable "
                   "returning (model, tokenizer)) or 'demo'. Default: the model path the trace "
                   "recorded, else the demo model. It must match the trace (class, vocab size, "
                   "module names, shapes), or whatif exits 2 saying what differs.")
@json_option("the results (schema qforensics.whatif, docs/whatif.md)")
@click.option("--max-new-tokens", default=32, show_default=True, type=click.IntRange(1, 512),
              help="Length of the reference's greedy answer the agreement is measured on.")
@click.option("--text-tokens", default=None, type=click.IntRange(8, None),
              help="Use only the first N tokens of the fixed perplexity text (default: all).")
@click.option("--engine", type=click.Choice(["hf", "vllm"]), default="hf", show_default=True,
              help="vllm: also measure the awq: and ct: schemes through vLLM's own kernels "
                   "(the checkpoint written in AutoAWQ's format, or by compressed-tensors "
                   "itself, served in a subprocess; perplexity from prompt logprobs, top-1 "
                   "against vLLM's unquantized bfloat16 run), next to the HF figures. A scheme "
                   "vLLM cannot run is reported with vLLM's error; exit 2 when none ran.")
@click.option("--vllm-python", metavar="PY",
              help="The Python that has vLLM (default: this one), e.g. .venv-vllm/bin/python.")
@click.option("--llmc-python", metavar="PY",
              help="The Python of llmcompressor's venv for llmc: schemes (scripts/install-llmc.sh"
                   "; default: $QF_LLMC_PYTHON, else .venv-llmc/bin/python). Calibration takes "
                   "minutes; its checkpoint is cached.")
@click.option("--target", "target", metavar="FLOOR",
              help="A quality floor, to recommend the scheme to ship: 99% (recovered "
                   "perplexity, the default metric) or top1:95% (text top-1 agreement). The "
                   "recommendation meets it with the least weight memory, then the most speed; "
                   "when none does, the closest is named with the Linears it would need in "
                   "bf16 (from the trace's recorded input ranges). Figures through vLLM count "
                   "where a scheme was served.")
@click.option("--speed-rounds", default=3, show_default=True, type=click.IntRange(0, 100),
              help="With --engine vllm: timed rounds per scheme (8 prompts x 64 tokens, 16 "
                   "new tokens), interleaved with the bf16 engine's, for decode and prefill "
                   "tokens/s as a ratio to bf16 (the median over rounds); 0: no speed figures.")
def command(trace: str, schemes: tuple[str, ...], keep_salient: str | None, table: bool,
            model_spec: str | None, json_path: str | None, max_new_tokens: int,
            text_tokens: int | None, engine: str, vllm_python: str | None,
            llmc_python: str | None, target: str | None, speed_rounds: int) -> None:
    """Rerun TRACE's prompt on the traced model under other quantization schemes.

    Compares each scheme with the unquantized reference: top-1 agreement (teacher-forced over
    the reference's answer), mean KL(ref || scheme), perplexity on a fixed text, and
    recovered = ppl_ref / ppl_scheme. Salient channels come from the activation ranges the
    trace recorded. Progress goes to stderr, one line per scheme. The model is --model, else
    the model path the trace recorded (said on stderr); a trace without one exits 2.

    \b
    Example:
        qforensics whatif trace.h5 --scheme int4-g128 --keep-salient 1%
        qforensics whatif trace.h5 --table --json whatif.json
        qforensics whatif trace.h5 --scheme int4-g128 --json | jq .schemes
        qforensics whatif trace.h5 --scheme ct:W4A16-g64 --scheme ct:W8A8 --target 99%
        qforensics whatif trace.h5 --model ./my-hf-model --scheme int4-g128 --scheme ct:W4A16
        qforensics whatif trace.h5 --scheme awq:w4a16-g64 --engine vllm
        qforensics whatif trace.h5 --engine vllm \\
            --scheme ct:mlp=W4A16-g64,attn=W8A8,keep=model.layers.11.mlp.down_proj
        qforensics whatif trace.h5 --scheme ct:W4A16 --scheme ct:W8A8 --engine vllm \\
            --vllm-python .venv-vllm/bin/python
        qforensics whatif trace.h5 --scheme llmc:GPTQ-W4A16-g64 --scheme llmc:SQ-W8A8 \\
            --llmc-python .venv-llmc/bin/python --engine vllm --vllm-python .venv-vllm/bin/python
    """
    from qforensics.trace.reader import open_trace
    from qforensics.whatif.run import (
        TABLE_SCHEMES,
        parse_keep_salient,
        parse_target,
        parse_whatif_scheme,
        run_whatif,
    )

    goal = parse_target(target)  # a bad floor: exit 2 before loading
    ks = parse_keep_salient(keep_salient)
    if ks is not None and not schemes:
        raise UsageError("--keep-salient applies to the INT weight schemes of --scheme; "
                         "give --scheme (e.g. --scheme int4-g128 --keep-salient 1%)")
    parsed = [parse_whatif_scheme(s, ks) for s in schemes]  # bad spec: exit 2 before loading
    if ks is not None and not any(p.weights is not None and p.weights.kind == "int"
                                  for p in parsed):
        raise UsageError("--keep-salient needs an INT weight scheme among --scheme "
                         "(e.g. int4-g128)")
    if table:
        parsed = [parse_whatif_scheme(s) for s in TABLE_SCHEMES] + parsed
    if not parsed:
        raise UsageError("nothing to run: give --scheme SPEC (repeatable) or --table")
    from qforensics.whatif.model import resolve_model_source

    if engine == "vllm":
        from qforensics.whatif.run import SERVED
        from qforensics.whatif.through_vllm import resolve_vllm_python

        if not any(p.library in SERVED for p in parsed):
            raise UsageError("--engine vllm measures awq:w4a16[-g<N>], ct:PRESET and llmc: "
                             "schemes through vLLM; give one (e.g. --scheme ct:W4A16)")
        resolve_vllm_python(vllm_python)  # no vLLM: exit 2 before loading
    if any(p.library == "llmcompressor" for p in parsed):
        from qforensics.whatif.llmc import resolve_llmc_python

        llmc_python = resolve_llmc_python(llmc_python)  # no llmcompressor: exit 2 now
    out = json_out(json_path, [trace])  # a bad --json PATH: exit 2 before loading
    with open_trace(trace) as t:  # unreadable trace: exit 2 before loading the model
        resolve_model_source(model_spec, t.meta)  # bad --model: exit 2 before loading

    result = run_whatif(trace, parsed, max_new_tokens=max_new_tokens, text_tokens=text_tokens,
                        model_spec=model_spec, progress=lambda msg: click.echo(msg, err=True),
                        engine=engine, vllm_python=vllm_python, llmc_python=llmc_python,
                        target=goal, speed_rounds=speed_rounds)
    out.text(result.format_table())
    out.write(document("qforensics.whatif", result.to_json()))
    if all(s.error is not None for s in result.schemes):
        raise UsageError("no scheme could be measured (the reasons are above)")
    tried = [s.vllm for s in result.schemes if isinstance(s.vllm, dict) and
             ("ppl" in s.vllm or "error" in s.vllm)]
    if tried and not any("ppl" in v for v in tried):
        raise UsageError("--engine vllm: vLLM could not serve any of the schemes (its errors "
                         "are above)")
    if any(math.isnan(s.top1) for s in result.schemes):
        click.echo("note: no continuation positions to compare (the reference answered "
                   "nothing)", err=True)
