"""What-if through vLLM's real kernels (`qforensics whatif TRACE --engine vllm --scheme ...`).

Two kinds of scheme have a published checkpoint format vLLM serves, and are measured two ways,
side by side:

- ``awq:w4a16[-g<N>]`` (AWQ W4A16: asymmetric uint4 with zero points, min/max per group of N
  input rows, default 128). **HF fake-quant**: every Linear but ``lm_head`` gets the weight the
  AWQ checkpoint holds, dequantized (the writer's own quantizer,
  `qforensics.demo.vllm_checkpoints.awq_quantize`), in the model's dtype. **vLLM**: the same
  quantizer writes an AutoAWQ GEMM folder; vLLM runs its own AWQ method and CPU kernel (W4A16,
  or W4A8 on AMX CPUs unless VLLM_CPU_INT4_W4A8=0).
- ``ct:PRESET[-g<N>]`` (compressed-tensors' presets). **HF**: the library's own quantized
  forward (`qforensics.whatif.library`). **vLLM**: the library writes the checkpoint from that
  same quantized state (`qforensics.whatif.ct_checkpoint`); vLLM runs its compressed-tensors
  method with the scheme and CPU kernel it picks for the preset (the engine info names both).
  A preset vLLM cannot run here is reported with vLLM's own error, per preset.

For ``--engine vllm`` the model is also written unquantized in bfloat16; each folder is served
by vLLM in a subprocess (``python -m qforensics.demo.vllm_serve --score-ids``, one engine start
each), bfloat16 activations. All score the same token sequences with prompt logprobs: the
fixed perplexity text and the trace's prompt followed by the HF reference's answer.

vLLM figures, each against vLLM's own unquantized bfloat16 run: perplexity on the text
(exp of the mean negative prompt logprob), recovered = ppl_ref / ppl, text top-1 (how often the
scheme's top-1 token equals the unquantized run's over the text) and answer top-1 (the same over
the answer positions). The HF figures are against the HF model as loaded (float32 for the demo).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qforensics.errors import UsageError
from qforensics.whatif.speed import SpeedPlan, SpeedTimer
from qforensics.whatif.checkpoints import (  # noqa: F401  (awq:'s own, named here too)
    AWQ_SPEC,
    applied_awq,
    awq_group,
    base_state,
    check_awq_fits,
    write_checkpoint,
)
from qforensics.whatif.memory import memory_figures, served_weight_bytes
from qforensics.whatif.vllm_engine import ServedEngine, VllmRunError, root_cause, wait_group

__all__ = ["AWQ_SPEC", "VllmRunError", "applied_awq", "attach_vllm_figures", "awq_group",
           "check_awq_fits", "measure_through_vllm", "resolve_vllm_python", "wait_group",
           "write_checkpoint"]

def resolve_vllm_python(given: str | None) -> str:
    """The Python that runs vLLM: --vllm-python, else this one when vLLM imports here."""
    if given:
        p = shutil.which(given) or given
        if not os.path.isfile(p) or not os.access(p, os.X_OK):
            raise UsageError(f"--vllm-python {given}: not an executable")
        return p
    if importlib.util.find_spec("vllm") is None:
        raise UsageError("--engine vllm: vLLM is not installed in this Python; run whatif from "
                         "vLLM's venv (scripts/install-vllm.sh: .venv-vllm/bin/qforensics) or "
                         "pass --vllm-python PATH")
    return sys.executable


# -- serving (qforensics.whatif.vllm_engine) --------------------------------------------------
def _ppl(logprobs: list[float]) -> float:
    if not logprobs or not all(math.isfinite(v) for v in logprobs):
        return float("nan")
    return math.exp(-sum(logprobs) / len(logprobs))


def _agree(a: list[int], b: list[int]) -> float:
    return sum(int(x == y) for x, y in zip(a, b)) / len(a) if a else float("nan")


def measure_through_vllm(model: Any, tokenizer: Any, schemes: list[Any], text_ids: list[int],
                         answer_seq: list[int], n_prompt: int, *, python: str,
                         progress: Callable[[str], None] = lambda m: None,
                         timeout: float = 1800, prebuilt: dict[str, Path] | None = None,
                         plan: SpeedPlan | None = SpeedPlan()) -> dict[str, dict[str, Any]]:
    """{scheme label: vLLM figures} for each ``awq:`` / ``ct:`` scheme (see the module
    docstring); a scheme vLLM could not serve gets ``{"error": vLLM's last words}`` and the
    others go on. The unquantized reference failing raises `VllmRunError`. ``prebuilt``:
    {label: checkpoint folder} served as it is (llmc: schemes, written by llmcompressor).
    ``plan``: the speed rounds, interleaved with the bf16 engine's (`qforensics.whatif.speed`;
    None: no speed figures)."""
    from qforensics.demo.vllm_model import save_model_folder as _save_folder

    with tempfile.TemporaryDirectory(prefix="qforensics-whatif-vllm-") as tmp, \
            contextlib.ExitStack() as stack:
        work = Path(tmp)
        base = base_state(model)
        progress(f"vLLM: writing the bfloat16 checkpoint into {work}")
        ref_dir = _save_folder(work / "ref-bf16", base[0], dict(base[1]), tokenizer)
        ref_bytes = served_weight_bytes(ref_dir)
        seqs = [list(text_ids), list(answer_seq)]
        progress("vLLM: scoring the unquantized bfloat16 model (one engine start, kept up "
                 "for the speed rounds)")
        bf16 = stack.enter_context(ServedEngine(python, ref_dir, seqs, work))
        ref = bf16.scores(timeout)
        timer = SpeedTimer(bf16, text_ids, plan, progress)
        out: dict[str, dict[str, Any]] = {}
        for sc in schemes:
            if sc.label in (prebuilt or {}):
                folder, said = Path(prebuilt[sc.label]), {"checkpoint": "llmcompressor's"}
            else:
                progress(f"vLLM: writing the {sc.label} checkpoint")
                folder, said = write_checkpoint(model, tokenizer, sc, base, work)
            said = {**said, "memory": memory_figures(served_weight_bytes(folder), ref_bytes)}
            progress(f"vLLM: scoring {sc.label} (one engine start)")
            try:
                with ServedEngine(python, folder, seqs, work) as eng:
                    got = eng.scores(timeout)
                    speed = timer.time(sc.label, eng)
            except VllmRunError as exc:
                out[sc.label] = {"error": str(exc), **said}
                progress(f"{sc.label} (vLLM): not measured: {exc}")
                continue
            out[sc.label] = {**_figures(ref, got, n_prompt), **said, "speed": speed}
            if sc.label not in (prebuilt or {}):  # a prebuilt one is the caller's (a cache)
                shutil.rmtree(folder, ignore_errors=True)
    return out


def attach_vllm_figures(result: Any, parsed: list[Any], wi: Any, served: list[Any],
                        python: str, say: Callable[[str], None], speed_rounds: int = 3) -> None:
    """Measure ``served`` through vLLM and put the figures (and each checkpoint's memory) on
    ``result``'s schemes, in the order of ``parsed``; ``wi``: the run's `WhatIf`;
    ``speed_rounds``: timed rounds against bf16 per scheme (0: no speed figures)."""
    figs = measure_through_vllm(wi.model, wi.tokenizer, served, wi.text_ids[0].tolist(),
                                wi.ref_full[0].tolist(), wi.n_prompt, python=python,
                                progress=say, prebuilt=wi.llmc_folders,
                                plan=SpeedPlan(rounds=speed_rounds) if speed_rounds else None)
    for r, sc in zip(result.schemes, parsed):
        got = figs.get(sc.label)
        r.memory = got.pop("memory", None) if got else None
        sp = got.get("speed") if got else None
        if isinstance(sp, dict) and "decode_vs_bf16" in sp:  # qforensics.whatif.speed
            r.decode_speed_vs_bf16, r.prefill_speed_vs_bf16 = (sp["decode_vs_bf16"],
                                                               sp["prefill_vs_bf16"])
        r.vllm = ({"error": f"not calibrated: {r.error}"} if r.error else None) or got or {
            "skipped": "vLLM runs published checkpoint formats (awq:, ct:, llmc:); this "
                       "scheme is measured by the HF path only"}
        v = r.vllm
        if "ppl" in v:
            say(f"{r.scheme} (vLLM): answer top-1 {100 * v['top1']:.1f}%, ppl "
                f"{v['ppl']:.2f} (vLLM bf16 reference {v['ref_ppl']:.2f}), recovered "
                f"{100 * v['recovered']:.1f}%; {v['path']}")


def _kernel(eng: dict) -> str:
    """The CPU kernel path vLLM's quantized linears took, from vllm_serve's engine info."""
    w4a8 = eng.get("use_w4a8")
    path = ("W4A8 (int8 activations)" if w4a8 == [True] else "W4A16" if w4a8 == [False]
            else "")
    kernels = ", ".join(eng.get("kernels") or {})
    if path and kernels:
        return f"{path} ({kernels})"
    return path or kernels or "unknown"


def _figures(ref: dict, got: dict, n_prompt: int) -> dict[str, Any]:
    r_text, r_ans = ref["scores"]
    s_text, s_ans = got["scores"]
    ref_ppl, ppl = _ppl(r_text["token_logprobs"]), _ppl(s_text["token_logprobs"])
    lo = max(0, n_prompt - 1)  # top1[i] predicts token i + 1: the answer starts at n_prompt
    eng = got.get("engine", {})
    methods = ", ".join(eng.get("quant_methods", {})) or "?"
    schemes = ", ".join(f"{k} x{v}" for k, v in (eng.get("schemes") or {}).items())
    return {
        "path": f"vLLM {eng.get('vllm', '?')}: {methods}" + (f" ({schemes})" if schemes else "")
                + f", CPU kernel {_kernel(eng)}, bfloat16",
        "ppl": ppl, "ref_ppl": ref_ppl,
        "recovered": ref_ppl / ppl if math.isfinite(ppl) and ppl > 0 else 0.0,
        "text_top1": _agree(s_text["top1"], r_text["top1"]),
        "top1": _agree(s_ans["top1"][lo:], r_ans["top1"][lo:]),
        "positions": len(s_ans["top1"][lo:]), "text_positions": len(s_text["top1"]),
        "nonfinite": not all(math.isfinite(v) for v in s_text["token_logprobs"]),
        "engine": eng,
        "engine_memory": _engine_memory(eng, ref.get("engine", {})),
    }


def _engine_memory(eng: dict, ref_eng: dict) -> dict[str, Any] | None:
    """The engine process's resident memory serving the scheme, against serving bfloat16
    (vllm_serve reads it in vLLM's worker after scoring: weights, KV cache, runtime)."""
    rss, ref_rss = eng.get("rss_bytes"), ref_eng.get("rss_bytes")
    if not isinstance(rss, int) or not isinstance(ref_rss, int) or ref_rss <= 0:
        return None
    return {"rss_bytes": rss, "bf16_rss_bytes": ref_rss, "vs_bf16": rss / ref_rss,
            "what": "vLLM engine process VmRSS after scoring (weights, KV cache, runtime)"}
