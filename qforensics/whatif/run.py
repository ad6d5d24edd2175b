"""What-if: rerun a trace's prompt on the real model under other quantization schemes.

For each scheme: quantize the demo model (SmolLM2-135M-Instruct; weights in place through
`quantize_weights`, activations inside each Linear through `emulate_quantized_linears`), and
compare it with the unquantized reference on

- top-1 agreement: teacher-forced over the reference's greedy continuation of the prompt (the
  fraction of those positions where the scheme's argmax is the reference token);
- mean KL(ref || scheme) of the next-token distributions over the same positions;
- perplexity on a fixed English text shipped with the package (``qforensics/data``), and the
  top-1 agreement with the reference over that text (many more positions than the answer);
- recovered = ppl_ref / ppl_scheme: the fraction of reference quality kept (0 without a finite
  perplexity).

Salient channels (``-salient<P>pct`` / ``keep_salient``) are chosen from the activation ranges
RECORDED in the trace (`qforensics.whatif.salient`); only when the trace has none is a
calibration pass run on the prompt, and the result says so.

The reference is the model as loaded: the GGUF dequantized to float32, the unquantized model
(what the report and the scenarios call the FP16 reference).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from importlib import resources
from typing import Any

from qforensics.errors import UsageError
from qforensics.whatif.model import load_demo
from qforensics.whatif.recommend import Target, parse_target
from qforensics.whatif.results import SchemeResult, WhatIfResult
from qforensics.whatif.schemes import (
    TABLE_SCHEMES,
    WhatIfScheme,
    parse_keep_salient,
    parse_whatif_scheme,
)

log = logging.getLogger(__name__)
# schemes --engine vllm serves (whatif.through_vllm)
SERVED = ("awq", "compressed-tensors", "llmcompressor")

__all__ = ["TABLE_SCHEMES", "SchemeResult", "Target", "WhatIf", "WhatIfResult", "WhatIfScheme",
           "demo_prompt_ids", "load_demo", "parse_keep_salient", "parse_target",
           "parse_whatif_scheme", "reference_text", "run_whatif"]

TEXT_RESOURCE = "perplexity.txt"

# -- model and inputs ---------------------------------------------------------------------------
def reference_text() -> str:
    """The fixed English text the perplexity is measured on (shipped in qforensics/data)."""
    return resources.files("qforensics").joinpath("data", TEXT_RESOURCE).read_text("utf-8")


def demo_prompt_ids(tokenizer: Any) -> Any:
    from qforensics.demo.scenarios import PROMPT

    enc = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                        add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)
    return enc["input_ids"]


class WhatIf:
    """The model, the prompt and the reference, computed once; `measure` runs one scheme."""

    def __init__(self, model: Any, tokenizer: Any, input_ids: Any, *, max_new_tokens: int = 32,
                 text_tokens: int | None = None) -> None:
        import torch

        self.model, self.tokenizer = model, tokenizer
        self.input_ids = input_ids.reshape(1, -1).to(torch.long)
        self.n_prompt = self.input_ids.shape[1]
        self.max_new_tokens = max_new_tokens
        ids = tokenizer(reference_text(), return_tensors="pt")["input_ids"]
        if text_tokens is not None:
            ids = ids[:, : max(2, int(text_tokens))]
        self.text_ids = ids
        self.ref_full = self._generate()
        self.ref_text = self._decode(self.ref_full)
        ref_logits = self._continuation_logits()
        self.ref_cont = ref_logits
        self.targets = self.ref_full[0, self.n_prompt:]
        txt_logits = self._text_logits()
        from qforensics.whatif.metrics import perplexity

        self.ref_ppl = perplexity(txt_logits[:-1], self.text_ids[0, 1:])
        self.ref_text_argmax = txt_logits[:-1].argmax(-1)
        del txt_logits
        self._absmax: dict[str, Any] | None = None
        self.llmc_folders: dict[str, Any] = {}  # llmc: label -> checkpoint (whatif.llmc)

    def _generate(self) -> Any:
        import torch

        with torch.inference_mode():
            return self.model.generate(
                self.input_ids, attention_mask=torch.ones_like(self.input_ids),
                max_new_tokens=self.max_new_tokens, do_sample=False, temperature=None,
                top_p=None, top_k=None, pad_token_id=self.tokenizer.eos_token_id)

    def _decode(self, full: Any) -> str:
        return self.tokenizer.decode(full[0, self.n_prompt:].tolist(), skip_special_tokens=False)

    def _continuation_logits(self) -> Any:
        import torch

        with torch.inference_mode():
            logits = self.model(self.ref_full).logits[0]
        return logits[self.n_prompt - 1:-1].float()

    def _text_logits(self) -> Any:
        import torch

        with torch.inference_mode():
            return self.model(self.text_ids).logits[0].float()

    @contextlib.contextmanager
    def applied(self, sc: WhatIfScheme, absmax: dict[str, Any] | None) -> Iterator[None]:
        from qforensics.quant import emulate_quantized_linears, quantize_weights

        with contextlib.ExitStack() as stack:
            if sc.library == "compressed-tensors":
                from qforensics.whatif.library import applied_compressed_tensors

                stack.enter_context(applied_compressed_tensors(self.model, sc.preset))
            if sc.library == "llmcompressor":  # the calibrated checkpoint's model
                from qforensics.whatif.llmc import applied_llmc

                stack.enter_context(applied_llmc(self, self.llmc_folders[sc.label]))
            if sc.library == "awq":
                from qforensics.whatif.through_vllm import applied_awq

                stack.enter_context(applied_awq(self.model, sc.awq_group))
            if sc.weights is not None:
                stack.enter_context(quantize_weights(self.model, sc.weights,
                                                     act_absmax=absmax if sc.needs_salient
                                                     else None))
            if sc.activations is not None:  # lm_head stays unquantized, like the scenarios
                stack.enter_context(emulate_quantized_linears(self.model, sc.activations,
                                                              exclude=("lm_head",)))
            yield

    def measure(self, sc: WhatIfScheme, absmax: dict[str, Any] | None = None) -> SchemeResult:
        import torch

        from qforensics.whatif.metrics import (
            mean_kl,
            perplexity,
            recovered_fraction,
            top1_agreement,
        )

        t0 = time.time()
        with self.applied(sc, absmax):
            cont = self._continuation_logits()
            txt = self._text_logits()
            own = self._generate()
        top1 = top1_agreement(cont, self.targets)
        kl = mean_kl(self.ref_cont, cont)
        ppl = perplexity(txt[:-1], self.text_ids[0, 1:])
        text_top1 = top1_agreement(txt[:-1], self.ref_text_argmax)
        nonfinite = not (bool(torch.isfinite(cont).all()) and bool(torch.isfinite(txt).all()))
        return SchemeResult(
            scheme=sc.label, weights=str(sc.weights) if sc.weights else (
                f"{sc.library} {sc.preset}" if sc.library else None),
            activations=str(sc.activations) if sc.activations else None, top1=top1, kl=kl,
            ppl=ppl, text_top1=text_top1, recovered=recovered_fraction(self.ref_ppl, ppl),
            nonfinite=nonfinite, text=self._decode(own), seconds=round(time.time() - t0, 2))


def _absmax_for(whatif: WhatIf, trace_path: str | None, say: Callable[[str], None]
                ) -> tuple[dict[str, Any], str]:
    """{module: float32 tensor [K]} for every Linear the weight schemes quantize."""
    import torch

    from qforensics.quant import collect_input_absmax
    from qforensics.quant.model import find_linears
    from qforensics.whatif.salient import absmax_from_trace

    names = [n for n, _ in find_linears(whatif.model, ("lm_head",))]
    found: dict[str, Any] = {}
    source = "no trace given"
    if trace_path is not None:
        ta = absmax_from_trace(trace_path, names)
        found = {n: torch.from_numpy(a.copy()) for n, a in ta.absmax.items()}
        source = ta.describe()
    missing = [n for n in names if n not in found]
    if missing:
        why = ("the trace has none" if not found else
               f"the trace has no channel ranges for {len(missing)} of {len(names)} Linears")
        say(f"salient channels: {why}; running a calibration pass on the prompt for them")
        calib = collect_input_absmax(whatif.model, lambda: whatif.model(whatif.input_ids),
                                     exclude=("lm_head",))
        for n in missing:
            if n in calib:
                found[n] = calib[n]
        source = (f"{source}; calibration pass on the prompt for {len(missing)} Linears"
                  if trace_path is not None and len(missing) < len(names)
                  else f"calibration pass on the prompt ({why})")
    return found, source


def engine_prompt_ids(trace: Any) -> Any:
    """A serving-engine (vLLM) trace: the prompt of its first request, gathered from its
    prefill rows (a step's input ids hold the rows of several requests), else None."""
    rows = trace.engine_table("rows")
    if not len(rows):
        return None
    import numpy as np

    first = rows[(rows["request"] == rows["request"].min()) & (rows["phase"] == 0)]
    first = first.sort_values("position").drop_duplicates("position")
    parts = []
    for step, g in first.groupby("step", sort=True):
        step_ids = np.asarray(trace.input_ids(int(step)))
        idx = g["row"].to_numpy()
        if len(idx) and int(idx.max()) >= len(step_ids):
            return None  # rows beyond the recorded ids: not trustworthy
        parts.append(step_ids[idx])
    return np.concatenate(parts) if parts else None


def run_whatif(
    trace: str | os.PathLike[str] | None,
    schemes: Sequence[str | WhatIfScheme],
    *,
    keep_salient: float | None = None,
    model: Any = None,
    tokenizer: Any = None,
    model_spec: str | None = None,
    max_new_tokens: int = 32,
    text_tokens: int | None = None,
    progress: Callable[[str], None] | None = None,
    engine: str = "hf",
    vllm_python: str | None = None,
    llmc_python: str | None = None,
    target: Target | None = None,
    speed_rounds: int = 3,
) -> WhatIfResult:
    """Rerun the trace's prompt under each scheme and compare with the unquantized reference.

    ``schemes`` are what-if specs (see `parse_whatif_scheme`; `TABLE_SCHEMES` for the scenario
    table). ``model``/``tokenizer`` are the model to run; without them ``model_spec`` (an HF
    folder, a .gguf file, ``module:factory`` or "demo"; default: the path the trace recorded,
    else the demo model) is loaded (`qforensics.whatif.model`). With a trace, the model must
    match it (class, vocab size, module names, shapes): `UsageError` otherwise. ``progress``
    receives one line per scheme. Every weight change is undone before returning.
    ``engine="vllm"`` also measures the ``awq:`` and ``ct:`` schemes through vLLM's kernels
    (`qforensics.whatif.through_vllm`; ``vllm_python``: the Python that has vLLM), next to the
    HF fake-quant figures, in each result's ``vllm``. ``llmc:`` schemes are calibrated by
    llmcompressor in ``llmc_python`` (`qforensics.whatif.llmc`), each next to its ``ct:`` twin
    (the same preset with min/max scales), added when not given. Each scheme with a checkpoint
    format gets its weight memory against bf16 (`qforensics.whatif.memory`); ``target`` (a
    `Target`, see `parse_target`) adds the ``recommendation`` (`qforensics.whatif.recommend`).
    Through vLLM, ``speed_rounds`` timed rounds per scheme give its speed against bf16
    (`qforensics.whatif.speed`; 0: none); every scheme gets the trace's ``risk``.
    """
    say = progress or (lambda msg: None)
    parsed = [s if isinstance(s, WhatIfScheme) else parse_whatif_scheme(s, keep_salient)
              for s in schemes]
    if not parsed:
        raise UsageError("no scheme to run: give --scheme (repeatable) or --table")
    lpy = None
    if any(s.library == "llmcompressor" for s in parsed):
        from qforensics.whatif.llmc import resolve_llmc_python, with_twins

        lpy = resolve_llmc_python(llmc_python)  # before loading anything
        parsed = with_twins(parsed)
    if engine not in ("hf", "vllm"):
        raise UsageError(f"unknown engine {engine!r}: hf or vllm")
    python = None
    if engine == "vllm":
        from qforensics.whatif.through_vllm import resolve_vllm_python

        if not any(s.library in SERVED for s in parsed):
            raise UsageError("--engine vllm measures awq:w4a16[-g<N>] and ct:PRESET schemes "
                             "through vLLM; give one (e.g. --scheme ct:W4A16)")
        python = resolve_vllm_python(vllm_python)  # before loading anything
    from qforensics.whatif.model import (ModelSource, check_model_matches, load_model_source,
                                         resolve_model_source)

    trace_path = os.fspath(trace) if trace is not None else None
    ids = None
    meta: dict[str, Any] = {}
    prompt_source = "the demo prompt (no trace given)"
    if trace_path is not None:
        from qforensics.trace.reader import open_trace

        with open_trace(trace_path) as t:
            meta = t.meta
            what = "step-0 input ids"
            if t.n_steps:
                try:
                    ids = engine_prompt_ids(t)
                    if ids is not None:
                        what = "first request's prompt"
                    else:
                        ids = t.input_ids(int(t.steps["step"].iloc[0]))
                except Exception as exc:  # malformed ids: say so, use the demo prompt
                    log.warning("%s: cannot read the prompt's input ids (%s)", trace_path, exc)
                    ids = None
            prompt_source = (f"the trace's {what} ({len(ids)} tokens)"
                             if ids is not None and len(ids) else
                             "the demo prompt (the trace stores no input ids)")
            if ids is not None and not len(ids):
                ids = None
    if model is None or tokenizer is None:
        src = resolve_model_source(model_spec, meta)
        say(f"loading {src.describe()}")
        model, tokenizer = load_model_source(src)
    else:
        src = ModelSource("given", type(model).__name__, "the caller")
    if trace_path is not None:
        check_model_matches(trace_path, model, src)
    import torch

    input_ids = torch.as_tensor(ids, dtype=torch.long) if ids is not None else \
        demo_prompt_ids(tokenizer)
    say(f"reference (unquantized): prompt from {prompt_source}")
    wi = WhatIf(model, tokenizer, input_ids, max_new_tokens=max_new_tokens,
                text_tokens=text_tokens)
    say(f"reference: ppl {wi.ref_ppl:.2f}; answer {wi.ref_text!r}")
    absmax = None
    salient_source = "not needed (no salient scheme)"
    if any(s.needs_salient for s in parsed):
        absmax, salient_source = _absmax_for(wi, trace_path, say)
    result = WhatIfResult(trace=trace_path, prompt_source=prompt_source,
                          salient_source=salient_source, ref_text=wi.ref_text,
                          ref_ppl=wi.ref_ppl, positions=int(wi.targets.numel()),
                          text_tokens=int(wi.text_ids.shape[1]))
    llmc: dict[str, Any] = {}
    if lpy is not None:
        from qforensics.whatif.llmc import prepare_llmc

        llmc = prepare_llmc(model, tokenizer, parsed, lpy, say)
        wi.llmc_folders = {k: f for k, (f, _) in llmc.items() if f is not None}
    for k, sc in enumerate(parsed):
        if sc.library == "llmcompressor":
            from qforensics.whatif.llmc import measure_llmc

            result.schemes.append(measure_llmc(wi, sc, llmc[sc.label], say))
            continue
        if sc.library == "awq":
            from qforensics.whatif.through_vllm import check_awq_fits

            check_awq_fits(model, sc.awq_group)
        r = wi.measure(sc, absmax)
        result.schemes.append(r)
        say(f"[{k + 1}/{len(parsed)}] {r.scheme} (HF fake-quant): top-1 {100 * r.top1:.1f}%, "
            f"KL {r.kl:.4f}, ppl {r.ppl:.2f}, recovered {100 * r.recovered:.1f}%"
            + (" (NaN logits)" if r.nonfinite else "") + f" [{r.seconds:.1f}s]")
    served = list({sc.label: sc for sc in parsed if sc.library in SERVED and (
        sc.library != "llmcompressor" or sc.label in wi.llmc_folders)}.values())
    if python is not None:
        from qforensics.whatif.through_vllm import attach_vllm_figures

        attach_vllm_figures(result, parsed, wi, served, python, say, speed_rounds)
    else:
        from qforensics.whatif.memory import checkpoint_memory

        mem = checkpoint_memory(model, tokenizer, served, prebuilt=wi.llmc_folders, say=say)
        for r in result.schemes:
            r.memory = mem.get(r.scheme)
    from qforensics.whatif.risk import attach_risk

    attach_risk(result, parsed, trace_path)  # what the trace predicts for each scheme
    if target is not None:
        from qforensics.whatif.recommend import recommend

        result.recommendation = recommend(result, target, lambda: (
            (absmax, salient_source) if absmax is not None else _absmax_for(wi, trace_path, say)))
    return result
