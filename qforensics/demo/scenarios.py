"""Real failing runs: SmolLM2-135M under quantization scenarios, each captured into a trace.

Every scenario runs the same fixed chat prompt with greedy decoding, capture on, and records its
outcome (first non-finite step, generated text, top-1 agreement with the reference) in the
trace's `outcome` metadata. Top-1 agreement is teacher-forced: the scenario's model reads the
reference's generated sequence once, and we count the positions where its argmax equals the
reference token, so one early divergence does not hide how close the rest is.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from qforensics.errors import UsageError

log = logging.getLogger(__name__)

PROMPT = "What is the capital of France? Answer in one short sentence."
MAX_NEW_TOKENS = 32
CORRUPT_MODULE = "model.layers.5.self_attn.o_proj"  # the corrupt-weight-nan-row scenario
CORRUPT_ROW = 100


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    weights: str | None = None  # weight scheme spec
    activations: str | None = None  # activation scheme spec (inside each Linear)
    expect: str = ""
    setup: str | None = None  # a named special set-up (static FP8 scales, corrupted parameter)


SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    Scenario("fp16-reference", "unquantized weights and activations (the GGUF dequantized to "
             "float32): the reference every other scenario is compared with",
             expect="fluent answer"),
    Scenario("fp8-e4m3-nosat-act", "FP8 e4m3 activations at every Linear input, without "
             "saturation (|x| > 448 -> NaN, as non-saturating conversions do)",
             activations="fp8-e4m3-nosat", expect="NaN from the prefill"),
    Scenario("int4-per-tensor-weights", "INT4 round-to-nearest weights, one scale per tensor",
             weights="int4-per-tensor", expect="no NaN, garbage text"),
    Scenario("int4-per-tensor-act", "INT4 activations, one dynamic scale per tensor",
             activations="int4-per-tensor", expect="garbage text"),
    Scenario("int8-per-tensor-act", "INT8 activations, one dynamic scale per tensor",
             activations="int8-per-tensor", expect="degraded but fluent"),
    Scenario("int4-g128-weights", "INT4 weights, group-wise scales (group 128): the first fix",
             weights="int4-g128", expect="near the reference"),
    Scenario("int4-g128-salient1pct", "INT4 g128 weights with the 1% most salient input "
             "channels (by recorded activation absmax) kept in FP16: the second fix",
             weights="int4-g128-salient1pct", expect="near the reference"),
    Scenario("fp8-e4m3-static-act", "FP8 e4m3 activations with a static per-tensor "
             "input_scale per Linear, calibrated on the prompt (absmax / 448), saturating: FP8 "
             "with correct scales", setup="fp8-static", expect="near the reference"),
    Scenario("fp8-e4m3-static-lowscale-act", "FP8 e4m3 activations with a static input_scale "
             "calibrated without the first token (the attention sink's massive activations "
             "never seen), saturating", setup="fp8-static-lowscale",
             expect="no NaN, garbage text"),
    Scenario("corrupt-weight-nan-row", f"one NaN in row {CORRUPT_ROW} of "
             f"{CORRUPT_MODULE}.weight (a corrupted checkpoint)", setup="corrupt-weight",
             expect="NaN from the prefill, caused by the weight"),
]}


@dataclass
class Outcome:
    scenario: str
    description: str
    prompt: str
    text: str
    generated_ids: list[int]
    first_nonfinite_step: int | None
    top1_agreement: float | None
    reference_text: str | None
    seconds: float
    trace: str
    weights: str | None = None
    activations: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class DemoModel:
    """The real model and tokenizer, loaded once, with helpers the scenarios share."""

    def __init__(self, prompt: str = PROMPT) -> None:
        from qforensics.demo.model import load_model

        self.model, self.tokenizer = load_model()
        self.prompt = prompt
        msgs = [{"role": "user", "content": prompt}]
        enc = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                 return_tensors="pt", return_dict=True)
        self.input_ids = enc["input_ids"]
        self.attention_mask = enc["attention_mask"]
        self._absmax: dict[str, Any] | None = None

    def generate(self, max_new_tokens: int) -> Any:
        import torch

        with torch.inference_mode():
            return self.model.generate(
                self.input_ids, attention_mask=self.attention_mask,
                max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None,
                top_k=None, pad_token_id=self.tokenizer.eos_token_id)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def teacher_forced_top1(self, ref_full: Any, n_prompt: int) -> float | None:
        """Fraction of the reference's generated positions where this model's argmax matches."""
        import torch

        n_gen = ref_full.shape[1] - n_prompt
        if n_gen <= 0:
            return None
        with torch.inference_mode():
            logits = self.model(ref_full).logits[0]
        pred = logits[n_prompt - 1:-1].argmax(-1)
        return float((pred == ref_full[0, n_prompt:]).float().mean())

    def activation_absmax(self) -> dict[str, Any]:
        """Per-input-channel activation absmax of every Linear on the prompt (for salient
        channel selection), computed once from the unquantized model."""
        if self._absmax is None:
            from qforensics.quant import collect_input_absmax

            self._absmax = collect_input_absmax(self.model, lambda: self.model(self.input_ids))
        return self._absmax

    @contextlib.contextmanager
    def applied(self, sc: Scenario) -> Iterator[None]:
        from qforensics.quant import emulate_quantized_linears, parse_scheme, quantize_weights

        with contextlib.ExitStack() as stack:
            if sc.weights:
                scheme = parse_scheme(sc.weights, "weights")
                act = self.activation_absmax() if "salient" in sc.weights else None
                stack.enter_context(quantize_weights(self.model, scheme, act_absmax=act))
            if sc.setup:
                stack.enter_context(self._special(sc.setup))
            if sc.activations:
                # lm_head stays unquantized, like the weight schemes (tied to the embedding)
                stack.enter_context(emulate_quantized_linears(self.model, sc.activations,
                                                              exclude=("lm_head",)))
            yield


    @contextlib.contextmanager
    def _special(self, setup: str) -> Iterator[None]:
        import torch

        from qforensics.quant.static import calibrate_input_scales, emulate_static_fp8

        if setup in ("fp8-static", "fp8-static-lowscale"):
            scales = calibrate_input_scales(
                self.model, lambda: self.model(self.input_ids),
                skip_tokens=1 if setup == "fp8-static-lowscale" else 0)
            with emulate_static_fp8(self.model, scales):
                yield
            return
        if setup == "corrupt-weight":
            w = dict(self.model.named_modules())[CORRUPT_MODULE].weight
            saved = w.detach()[CORRUPT_ROW].clone()
            try:
                with torch.no_grad():
                    w[CORRUPT_ROW, 7] = float("nan")
                yield
            finally:
                with torch.no_grad():
                    w[CORRUPT_ROW].copy_(saved)
            return
        raise UsageError(f"unknown scenario set-up {setup!r}")


def first_nonfinite_step(trace_path: str) -> int | None:
    """The first bad step of a trace (`trace.badstep`: a record or the logits; warm-ups left
    out)."""
    from qforensics.analyze.engine import warmup_steps
    from qforensics.trace.badstep import first_bad_step
    from qforensics.trace.reader import open_trace

    with open_trace(trace_path) as t:
        return first_bad_step(t.step_table, warmup=warmup_steps(t))


def run_scenarios(
    names: list[str] | None,
    out_dir: str | Path,
    *,
    max_new_tokens: int = MAX_NEW_TOKENS,
    capture_options: dict[str, Any] | None = None,
    prompt: str = PROMPT,
    progress: Callable[[str], None] | None = None,
) -> list[Outcome]:
    """Run the scenarios (all by default; the reference always runs first) and write
    `<out_dir>/<scenario>.h5`. Returns the outcomes, also stored in each trace."""
    from qforensics.hooks.capture import capture
    from qforensics.trace.writer import set_meta

    wanted = list(SCENARIOS) if not names else list(names)
    unknown = [n for n in wanted if n not in SCENARIOS]
    if unknown:
        raise UsageError(f"unknown scenario {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    if "fp16-reference" in wanted:
        wanted.remove("fp16-reference")
    wanted.insert(0, "fp16-reference")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda msg: None)
    say("loading SmolLM2-135M-Instruct (first run converts the GGUF, ~40 s)")
    dm = DemoModel(prompt)
    n_prompt = dm.input_ids.shape[1]
    outcomes: list[Outcome] = []
    ref_full = None
    ref_text = None
    for i, name in enumerate(wanted):
        sc = SCENARIOS[name]
        path = out / f"{name}.h5"
        say(f"[{i + 1}/{len(wanted)}] {name}: {sc.description}")
        t0 = time.time()
        with dm.applied(sc):
            opts = dict(capture_options or {})
            opts.setdefault("metadata", {})
            opts["metadata"] = {**opts["metadata"], "scenario": name, "prompt": prompt,
                                # what `whatif` reruns by default (qforensics.whatif.model)
                                "model_path": "demo"}
            with capture(dm.model, path, **opts):
                full = dm.generate(max_new_tokens)
            agree = (dm.teacher_forced_top1(ref_full, n_prompt) if ref_full is not None
                     else 1.0)
        gen = full[0, n_prompt:].tolist()
        text = dm.decode(gen)
        if ref_full is None:
            ref_full, ref_text = full, text
        oc = Outcome(
            scenario=name, description=sc.description, prompt=prompt, text=text,
            generated_ids=[int(x) for x in gen], first_nonfinite_step=first_nonfinite_step(
                str(path)), top1_agreement=agree, reference_text=ref_text,
            seconds=round(time.time() - t0, 2), trace=str(path), weights=sc.weights,
            activations=sc.activations, extra={"expect": sc.expect,
                                              "max_new_tokens": max_new_tokens},
        )
        set_meta(path, "outcome", oc.to_dict())
        outcomes.append(oc)
        say(format_outcome(oc))
    return outcomes


def format_outcome(oc: Outcome) -> str:
    nf = "none" if oc.first_nonfinite_step is None else f"step {oc.first_nonfinite_step}"
    agree = "n/a" if oc.top1_agreement is None else f"{100 * oc.top1_agreement:.1f}%"
    text = oc.text.replace("\n", "\\n")
    if len(text) > 70:
        text = text[:67] + "..."
    return (f"    first non-finite: {nf}; top-1 agreement with reference: {agree}; "
            f"{oc.seconds:.1f}s\n    text: {text!r}")
