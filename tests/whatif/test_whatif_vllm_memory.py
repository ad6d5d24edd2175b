"""`qforensics whatif --engine vllm --target 95%` on the demo trace: each served checkpoint's
weight memory against bf16, the engine's resident memory, and the recommendation.

Runs in vLLM's venv (marker `vllm`; scripts/run-tests.sh). The expected weight bytes are
derived here from the bfloat16 checkpoint vLLM serves for the demo (its Linears' shapes) and
the formats' definitions, not read back from the code: W8A8 (compressed-tensors int-quantized)
stores each Linear's weight as int8 plus one scale per output row; W4A16 group 64
(pack-quantized, symmetric) as 4-bit values packed into int32 words, one scale per 64 inputs
and an int64 [2] weight_shape. Floating tensors count at 2 bytes (served in bfloat16)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.model]
REPO = Path(__file__).resolve().parents[2]


def _bf16_layout() -> tuple[int, list[tuple[int, int]]]:
    """(bytes of the bf16 checkpoint, [(N, K)] of every Linear but lm_head)."""
    from safetensors import safe_open

    from qforensics.demo.vllm_model import vllm_model_dir

    total, shapes = 0, []
    for f in vllm_model_dir().glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                t = st.get_tensor(k)
                total += t.numel() * t.element_size()
                if k.endswith("_proj.weight"):
                    shapes.append(tuple(t.shape))
    return total, shapes


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from qforensics.demo.vllm_scenarios import serve_env

    out = tmp_path_factory.mktemp("whatif-vllm-mem") / "w.json"
    cmd = [sys.executable, "-m", "qforensics.cli", "whatif",
           str(REPO / "sample_traces" / "fp16-reference.h5"), "--scheme", "ct:W8A8",
           "--scheme", "ct:W4A16-g64", "--engine", "vllm", "--text-tokens", "256",
           "--max-new-tokens", "8", "--target", "95%", "--json", str(out)]
    proc = subprocess.run(cmd, env={**serve_env(), "VLLM_CPU_INT4_W4A8": "0"},
                          capture_output=True, text=True, timeout=1800, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout


def test_served_checkpoints_weigh_what_their_formats_say(run) -> None:
    doc, stdout = run
    ref, lin = _bf16_layout()
    assert len(lin) == 30 * 7  # q, k, v, o, gate, up, down per block
    w8 = ref + sum(-2 * n * k + n * k + 2 * n for n, k in lin)
    w4 = ref + sum(-2 * n * k + n * k // 2 + 2 * n * (k // 64) + 16 for n, k in lin)
    by = {s["scheme"]: s for s in doc["schemes"]}
    for label, want in (("ct:W8A8", w8), ("ct:W4A16-g64", w4)):
        mem = by[label]["memory"]
        assert mem["bf16_weight_bytes"] == ref and mem["weight_bytes"] == want, label
        assert by[label]["memory_vs_bf16"] == pytest.approx(want / ref)
    assert "weights" in stdout and "engine RSS" in stdout


def test_engine_memory_is_the_engine_process_own(run) -> None:
    doc, _ = run
    for s in doc["schemes"]:
        if "ppl" not in s["vllm"]:
            continue  # not served here (its reason is in vllm.error)
        em = s["vllm"]["engine_memory"]
        assert em["rss_bytes"] > s["memory"]["weight_bytes"]  # the weights live in it
        assert em["bf16_rss_bytes"] > s["memory"]["bf16_weight_bytes"]
        assert s["engine_memory_vs_bf16"] == pytest.approx(em["rss_bytes"] /
                                                           em["bf16_rss_bytes"])


def test_recommendation_follows_the_vllm_figures(run) -> None:
    doc, stdout = run
    rec = doc["recommendation"]
    assert rec["target"]["metric"] == "recovered" and rec["target"]["floor"] == 0.95
    served = {s["scheme"]: s for s in doc["schemes"] if "ppl" in s["vllm"]}
    assert served, "vLLM served no scheme"
    meeting = [k for k, s in served.items() if s["vllm"]["recovered"] >= 0.95]
    want = min(meeting, key=lambda k: served[k]["memory_vs_bf16"]) if meeting else None
    assert rec["scheme"] == want
    for c in rec["candidates"]:
        if c["scheme"] in served:
            assert c["from"] == "vLLM" and c["value"] == served[c["scheme"]]["vllm"]["recovered"]
    assert "recommendation (target recovered perplexity" in stdout
