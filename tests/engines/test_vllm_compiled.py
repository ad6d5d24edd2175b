"""`qforensics record` around vLLM in its default mode (torch.compile, no enforce_eager) on the
real engine and the real SmolLM2: the engine lives, the texts are those of the same program run
without capture, and every layer is recorded from inside the compiled graph, with the figures
of the same prompts recorded in eager mode."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from qforensics.analyze.analyzer import analyze_trace
from qforensics.trace.reader import open_trace
from tests.engines.conftest import PROMPT_A, PROMPT_B, run_recorded

pytestmark = pytest.mark.vllm
TOKENS = 12


def _texts(outputs: dict) -> list[str]:
    return [o["text"] for o in outputs["runs"][-1]["outputs"]]


@pytest.fixture(scope="module")
def plain_compiled(tmp_path_factory, bf16_model_dir) -> dict:
    """The same program without qforensics, compiled (vLLM's default)."""
    from qforensics.demo.vllm_scenarios import serve_env

    tmp = tmp_path_factory.mktemp("vllm-plain-compiled")
    out = tmp / "o.json"
    cmd = [sys.executable, "-m", "qforensics.demo.vllm_serve", str(bf16_model_dir),
           "--compiled", "--max-tokens", str(TOKENS), "--out", str(out),
           "--prompt", PROMPT_A, "--prompt", PROMPT_B]
    proc = subprocess.run(cmd, env=serve_env(), capture_output=True, text=True, timeout=1500,
                          cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def recorded_compiled(tmp_path_factory, bf16_model_dir) -> dict:
    tmp = tmp_path_factory.mktemp("vllm-rec-compiled")
    return run_recorded(tmp, bf16_model_dir, [PROMPT_A, PROMPT_B], TOKENS,
                        serve_args=["--compiled"])


@pytest.fixture(scope="module")
def recorded_eager(tmp_path_factory, bf16_model_dir) -> dict:
    tmp = tmp_path_factory.mktemp("vllm-rec-eager")
    return run_recorded(tmp, bf16_model_dir, [PROMPT_A, PROMPT_B], TOKENS)


def test_compiled_engine_lives_and_texts_match_the_plain_compiled_run(
        recorded_compiled, plain_compiled):
    assert _texts(recorded_compiled["outputs"]) == _texts(plain_compiled)
    assert all(len(t) > 0 for t in _texts(plain_compiled))


def test_every_layer_is_recorded_inside_the_graph(recorded_compiled):
    with open_trace(recorded_compiled["files"][0]) as t:
        st = t.meta["status"]
        eng = t.meta["environment"]["engine"]
        t_names = t.module_columns["name"]
        n_mod = len(t_names)
        kinds = list(t.module_columns["kind"])
        steps = t.steps
        rec = t.records()
    assert eng["enforce_eager"] is False and eng["compilation_mode"] != "NONE"
    assert st["capture_mode"] == "compiled" and st["hook_path"] == "graph"
    assert "graph_not_recorded" not in st
    # every hooked module but the root ran in the graph; the root is the logits' record
    # every hooked module ran in the graph; the root (the logits' record) and lm_head (the
    # logits processor's call, recorded by the adapter) outside it
    names = list(t_names)
    assert kinds[-1] == "root" and names[-2] == "lm_head"
    assert st["graph_calls"] == n_mod - 2 == sum(k in ("linear", "block") for k in kinds) - 1
    served = steps[steps["has_logits"] == 1]
    assert len(served) >= TOKENS
    for s in served["step"].tolist():
        mods = set(rec[rec.step == s].module_id)
        assert mods == set(range(n_mod)), s


def test_compiled_figures_are_those_of_eager_mode(recorded_compiled, recorded_eager):
    """The prefill step (one engine forward over both prompts) in both modes: the same records
    (module, io, slot, rows, channels) and the same figures within bf16 rounding (Inductor may
    fuse the model's own ops differently from eager)."""
    with open_trace(recorded_compiled["files"][0]) as tc, \
            open_trace(recorded_eager["files"][0]) as te:
        def prefill(t):
            es = t.engine_table("steps")
            s = int(es[(es["warmup"] == 0)]["step"].min())
            r = t.records()
            r = r[(r.step == s) & (r.dtype != 6)]  # int positions: other shape conventions
            return r.sort_values(["module_id", "io", "slot"]).reset_index(drop=True)
        a, b = prefill(te), prefill(tc)
    key = ["module_id", "io", "slot", "rows", "channels"]
    assert a[key].values.tolist() == b[key].values.tolist()
    early = a["module_id"].values < 20  # layers 0-3 (5 hooked modules each)
    for f in ("max", "min", "absmax"):
        x, y = a[f].values.astype(float), b[f].values.astype(float)
        # the first layers agree to bf16 rounding; deeper, the compiled model's own numerics
        # (Inductor keeps fused intermediates in float32) drift from eager's, by up to ~20%
        # here in a few layers' extremes, whatever capture does
        assert np.all((np.abs(x - y) <= 0.05 * np.abs(x) + 0.05)[early]), f
        assert np.all(np.abs(x - y) <= 0.3 * np.abs(x) + 0.5), f


def test_nan_row_found_in_compiled_mode(tmp_path, nan_row_model):
    """The NaN embedding row of prompt A's token, served compiled: the same first non-finite
    output as in eager mode (tests/engines/test_vllm_record.py): layer 0's qkv_proj, whose input
    (the unhooked embedding and norm's output) already holds it, in the first served step; the
    warm-up forward on vLLM's dummy batch never drives the verdict."""
    model_dir, _ = nan_row_model
    res = run_recorded(tmp_path, model_dir, [PROMPT_A, PROMPT_B], 4, serve_args=["--compiled"])
    rep = analyze_trace(str(res["files"][0]))
    assert rep.status == "FAILED"
    with open_trace(res["files"][0]) as t:
        assert t.meta["status"]["capture_mode"] == "compiled"
        names = list(t.module_columns["name"])
        es = t.engine_table("steps")
        steps = t.steps
        rec = t.records()
    served = set(es[es["warmup"] == 0]["step"].tolist())
    bad = steps[(steps["first_nonfinite_call"] >= 0) & steps["step"].isin(served)]
    assert int(bad["step"].iloc[0]) == min(served)  # the prefill of both prompts
    first = rec[rec.call_index == int(bad["first_nonfinite_call"].iloc[0])]
    assert names[int(first.module_id.iloc[0])] == "model.layers.0.self_attn.qkv_proj"
    assert (first[first.io == 0].nan_count > 0).all()  # already in its input
    assert rep.first_nonfinite is not None and rep.first_nonfinite.step == min(served)


def test_healthy_compiled_run_reads_passed_and_sees_the_massive_activation(
        recorded_compiled):
    """vLLM's compiled warm-up forward on its dummy batch makes NaN in attention; it is
    flagged and never drives the verdict. The served steps read PASSED, and the per-channel
    ranges from inside the graph show SmolLM2's known massive activation: input channel 1229 of
    layer 11's down_proj near 3,000 at the first token."""
    path = str(recorded_compiled["files"][0])
    rep = analyze_trace(path)
    assert rep.status == "PASSED", rep.verdict.line
    with open_trace(path) as t:
        es = t.engine_table("steps")
        prefill = int(es[es["warmup"] == 0]["step"].min())
        lo, hi = t.channels_for("model.layers.11.mlp.down_proj", prefill)
    peak = max(abs(lo[1229]), abs(hi[1229]))
    assert 1500 < peak < 6000
    assert int(np.argmax(np.maximum(np.abs(lo), np.abs(hi)))) == 1229
