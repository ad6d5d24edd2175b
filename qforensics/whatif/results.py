"""What-if results: one scheme's measurements and the whole comparison, with the text table
and the JSON form `qforensics whatif` prints and writes."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from qforensics.jsondoc import jsonable
from qforensics.whatif.risk import risk_lines
from qforensics.whatif.speed import speed_lines

__all__ = ["SchemeResult", "WhatIfResult"]


@dataclass
class SchemeResult:
    scheme: str
    weights: str | None
    activations: str | None
    top1: float  # teacher-forced agreement over the reference continuation
    kl: float  # mean KL(ref || scheme), nats, same positions
    ppl: float  # perplexity on the fixed text
    text_top1: float  # agreement with the reference argmax over the fixed text
    recovered: float  # ppl_ref / ppl
    nonfinite: bool  # the scheme produced NaN/Inf logits
    text: str  # the scheme's own greedy continuation
    seconds: float
    # the same scheme through vLLM's kernels (whatif --engine vllm; qforensics.whatif.through_vllm)
    vllm: dict[str, Any] | None = None
    error: str | None = None  # not measured (e.g. llmcompressor failed to calibrate): why
    library: dict[str, Any] | None = None  # what the library said (llmc: its llmc.json)
    # the checkpoint's weight bytes against bf16 (qforensics.whatif.memory), None: no format
    memory: dict[str, Any] | None = None
    # decode / prefill tokens/s through vLLM against bf16, interleaved (qforensics.whatif.speed)
    decode_speed_vs_bf16: float | None = None
    prefill_speed_vs_bf16: float | None = None
    risk: dict[str, Any] | None = None  # the trace's evidence (qforensics.whatif.risk)

    @property
    def memory_vs_bf16(self) -> float | None:
        m = self.memory
        return float(m["vs_bf16"]) if isinstance(m, dict) and "vs_bf16" in m else None

    @property
    def engine_memory_vs_bf16(self) -> float | None:
        e = self.vllm.get("engine_memory") if isinstance(self.vllm, dict) else None
        return float(e["vs_bf16"]) if isinstance(e, dict) else None

    def to_json(self) -> dict[str, Any]:
        """The scheme as the JSON holds it: non-finite figures as "nan" / "inf" (jsondoc's
        one policy), None (null) where a figure was not measured at all."""
        from qforensics.whatif.recommend import judged_figures

        d = asdict(self)
        d["path"] = "HF fake-quant (the model's dtype, against the model as loaded)"
        d["memory_vs_bf16"] = self.memory_vs_bf16
        d["engine_memory_vs_bf16"] = self.engine_memory_vs_bf16
        d["judged"] = judged_figures(self)
        return jsonable(d)


@dataclass
class WhatIfResult:
    trace: str | None
    prompt_source: str
    salient_source: str
    ref_text: str
    ref_ppl: float
    positions: int  # continuation positions compared
    text_tokens: int
    schemes: list[SchemeResult] = field(default_factory=list)
    recommendation: dict[str, Any] | None = None  # under --target (qforensics.whatif.recommend)

    def to_json(self) -> dict[str, Any]:
        return jsonable({
            "trace": self.trace,
            "prompt_source": self.prompt_source,
            "salient_source": self.salient_source,
            "reference": {"text": self.ref_text, "ppl": self.ref_ppl,
                          "positions": self.positions, "text_tokens": self.text_tokens},
            "schemes": [s.to_json() for s in self.schemes],
            "recommendation": self.recommendation,
        })

    def format_table(self) -> str:
        def pct(x: float) -> str:
            return "n/a" if not math.isfinite(x) else f"{100 * x:.1f}%"

        def num(x: float, fmt: str) -> str:
            return "nan" if math.isnan(x) else ("inf" if math.isinf(x) else format(x, fmt))

        def mem(x: float | None) -> str:
            return "-" if x is None else pct(x)

        def risk(s: SchemeResult) -> str:
            return str(s.risk["level"]) if isinstance(s.risk, dict) else "-"

        head = ("scheme", "top-1", "mean KL", "ppl", "text top-1", "recovered", "weights",
                "risk")
        rows = [("reference (unquantized)", "100.0%", "0", num(self.ref_ppl, ".2f"), "100.0%",
                 "100.0%", "100.0%", "")]
        for s in self.schemes:
            if s.error is not None:
                rows.append((s.scheme, *["-"] * 5, mem(s.memory_vs_bf16), risk(s)))
                continue
            rows.append((s.scheme + (" [NaN]" if s.nonfinite else ""), pct(s.top1),
                         num(s.kl, ".4f"), num(s.ppl, ".2f"), pct(s.text_top1),
                         pct(s.recovered), mem(s.memory_vs_bf16), risk(s)))
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                           for i, (c, w) in enumerate(zip(r, widths))) for r in [head, *rows]]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append("")
        lines.append(f"top-1: teacher-forced over the reference's {self.positions}-token answer; "
                     f"ppl and text top-1: {self.text_tokens} tokens of fixed text; "
                     "recovered = ppl_ref / ppl; weights: the checkpoint's weight bytes as "
                     "served, % of bf16 (- : no checkpoint format)")
        lines.append(f"salient channels: {self.salient_source}")
        lines += risk_lines(self.schemes)
        lines.append("these figures: HF fake-quant (qforensics' quantize-dequantize in the "
                     "model's dtype, against the unquantized model as loaded)")
        if any(s.scheme.startswith("ct:") for s in self.schemes):
            lines.append("  (ct: rows: compressed-tensors' own quantized forward, same dtype)")
        if any(s.scheme.startswith("llmc:") for s in self.schemes):
            lines.append("  (llmc: rows: llmcompressor's calibrated checkpoint, decompressed by "
                         "compressed-tensors, same dtype; its ct: twin has min/max scales)")
        lines += [f"{s.scheme}: not measured: {s.error}" for s in self.schemes if s.error]
        lines += self._vllm_lines(pct, num)
        rec = list((self.recommendation or {}).get("text") or [])  # recommend() wrote it
        return "\n".join([*lines, *([""] if rec else []), *rec])

    def _vllm_lines(self, pct: Any, num: Any) -> list[str]:
        done = [s for s in self.schemes if isinstance(s.vllm, dict) and "ppl" in s.vllm]
        failed = [f"{s.scheme} through vLLM: not measured: {s.vllm['error']}"
                  for s in self.schemes if isinstance(s.vllm, dict) and "error" in s.vllm]
        if not done:
            return ["", *failed] if failed else []
        head = ("scheme (through vLLM)", "answer top-1", "ppl", "ppl ref", "text top-1",
                "recovered", "weights", "engine RSS", "decode", "prefill")
        rows = [(s.scheme + (" [NaN]" if s.vllm.get("nonfinite") else ""),
                 pct(s.vllm["top1"]), num(s.vllm["ppl"], ".2f"), num(s.vllm["ref_ppl"], ".2f"),
                 pct(s.vllm["text_top1"]), pct(s.vllm["recovered"]),
                 *("-" if x is None else pct(x) for x in (s.memory_vs_bf16,
                                                          s.engine_memory_vs_bf16)),
                 *("-" if x is None else num(x, ".2f") + "x"
                   for x in (s.decode_speed_vs_bf16, s.prefill_speed_vs_bf16)))
                for s in done]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        out = ["", *["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))) for r in [head, *rows]]]
        out.insert(2, "  ".join("-" * w for w in widths))
        out.append("these figures: vLLM's own kernels on the scheme's checkpoint (AWQ, or "
                   "compressed-tensors written by the library), each against vLLM's "
                   "unquantized bfloat16 run of the same weights (top-1: same top token; "
                   "weights: the served checkpoint's; engine RSS: vLLM's engine process after "
                   "scoring, weights, KV cache and runtime together, % of serving bf16)")
        out += [f"  {s.scheme}: {s.vllm['path']}" for s in done]
        return out + speed_lines(done) + failed


# -- the run ---------------------------------------------------------------------------------
