"""Static activation scales inside the real engine: INT8 W8A8 checkpoints of the real SmolLM2
(compressed-tensors `int-quantized`) that vLLM runs with its own CPU INT8 kernels.

Expectations come from the checkpoint's own tensors and the INT8 format (a zero point z maps
inputs s x (-128 - z) .. s x (127 - z)), and from what is known of the model (channel 1229 of
layer 11's down_proj reaches about 3,000 at token 0), never from the trace's verdict text."""

from __future__ import annotations

import pytest

from qforensics.analyze.analyzer import analyze_trace
from qforensics.trace.moduleinfo import read_module_infos
from qforensics.trace.reader import open_trace
from vllm_runs import PROMPT_A, one_core, run_recorded, side_by_side

LAYER = "model.layers.11.mlp.down_proj"
OUTLIER = 1229


def _checkpoint(variant: str):
    from safetensors.torch import load_file

    from qforensics.demo.vllm_checkpoints import checkpoint_dir

    d = checkpoint_dir("int8", variant)
    return d, load_file(str(d / "model.safetensors"))


VARIANTS = {"clipped": "clipped-calibration", "calibrated": "ok",
            "symmetric": "sym-clipped-calibration"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """One engine start per checkpoint, all three at once (vllm_runs.side_by_side): prompt A
    and 2 greedy tokens. The checks read scales and ranges at the prompt's first token, not
    timing or decoding; on an AVX2-only CPU vLLM's oneDNN INT8 matmul is its reference
    implementation, seconds a token, so every token served costs."""
    ckpts = {k: _checkpoint(v) for k, v in VARIANTS.items()}  # built one at a time, here
    tmps = {k: tmp_path_factory.mktemp(f"int8-{v}") for k, v in VARIANTS.items()}

    def run(i: int, k: str) -> dict:
        d, sd = ckpts[k]
        return {**run_recorded(tmps[k], d, [PROMPT_A], 2, env=one_core(i)),
                "state": sd}

    return side_by_side({k: (lambda i=i, k=k: run(i, k)) for i, k in enumerate(VARIANTS)})


@pytest.fixture(scope="module")
def clipped(runs):
    return runs["clipped"]


@pytest.fixture(scope="module")
def calibrated(runs):
    return runs["calibrated"]


@pytest.fixture(scope="module")
def symmetric(runs):
    return runs["symmetric"]


def test_input_qparams_map_the_calibrated_range_onto_int8():
    from qforensics.demo.vllm_int8 import input_qparams

    s, z = input_qparams(-1.0, 3.0, symmetric=False)  # 4 / 255 per step; -1 lands on -128
    assert s == pytest.approx(4 / 255) and z == round(-128 + 1 / (4 / 255))
    assert s * (-128 - z) == pytest.approx(-1.0, abs=s) and s * (127 - z) == pytest.approx(
        3.0, abs=s)
    s, z = input_qparams(-1.0, 3.0, symmetric=True)
    assert (s, z) == (pytest.approx(3 / 127), 0)
    s, z = input_qparams(0.5, 2.0, symmetric=False)  # widened to hold 0
    assert s == pytest.approx(2 / 255) and z == -128


def _evidence(f, kind):
    return [e for e in f.evidence if e.kind == kind]


@pytest.mark.vllm
def test_clipped_input_scale_reads_suspect_naming_the_layer_scale_and_channel(clipped):
    sd = clipped["state"]
    s = float(sd[f"{LAYER}.input_scale"].reshape(()))
    z = int(sd[f"{LAYER}.input_zero_point"].reshape(()))
    lo, hi = s * (-128 - z), s * (127 - z)
    f = analyze_trace(clipped["files"][0])
    assert f.status == "SUSPECT" and f.exit_code == 1
    over = _evidence(f, "static_range_overrun")
    assert over and over[0].suspect and LAYER in over[0].modules
    d = next(x for x in over[0].details if x["module"] == LAYER)
    assert d["input_scale"] == pytest.approx(s, rel=1e-5)
    assert d["representable"] == pytest.approx([lo, hi], rel=1e-4)
    assert d["overrun"] >= 4.0
    assert OUTLIER in [c["channel"] for c in d["channels_over"]]
    assert "input_scale" in f.verdict.line and LAYER in f.verdict.line


@pytest.mark.vllm
def test_min_max_scales_never_saturate_but_the_outlier_stretched_one_zeroes_channels(calibrated):
    """Min/max calibration covers every input, so nothing saturates; but one per-tensor INT8
    scale for a layer whose channel 1229 reaches ~3,000 has a step of ~11, and half a step
    (5.5) is more than most of its channels ever reach: they round to zero (as in the HF demo's
    int8-per-tensor-act). oneDNN applies the scale (asymmetric input)."""
    sd = calibrated["state"]
    s = float(sd[f"{LAYER}.input_scale"].reshape(()))
    z = int(sd[f"{LAYER}.input_zero_point"].reshape(()))
    assert s * (127 - z) > 1000.0 and s / 2 > 2.0  # the outlier sets the range and the step
    f = analyze_trace(calibrated["files"][0])
    assert not _evidence(f, "static_range_overrun")
    under = _evidence(f, "static_range_underflow")
    assert under and LAYER in under[0].modules and f.status == "SUSPECT"
    with open_trace(calibrated["files"][0]) as t:
        infos = read_module_infos(t)
    st = infos.static_inputs[LAYER]
    assert st.applied and "onednn" in st.kernel
    assert st.hi == pytest.approx(s * (127 - z), rel=1e-4)
    assert st.lo == pytest.approx(s * (-128 - z), rel=1e-4)


@pytest.mark.vllm
def test_a_clipped_symmetric_scale_is_judged_by_the_kernel_that_runs_it(symmetric):
    """Symmetric static INT8: on a CPU with AMX tiles vLLM runs its SGL kernel, which quantizes
    each token with its own scale (the clipped input_scale is loaded but never used: no false
    alarm); elsewhere its oneDNN kernel applies the scale, and the outlier channel saturates
    (a true one). Which kernel runs is vLLM's `check_cpu_sgl_kernel`: AMX tiles."""
    import torch

    sd = symmetric["state"]
    s = float(sd[f"{LAYER}.input_scale"].reshape(()))
    assert s * 127 < 100.0  # clipped: far below the outlier channel's ~3,000
    f = analyze_trace(symmetric["files"][0])
    if not torch.cpu._is_amx_tile_supported():
        assert not _evidence(f, "static_scale_unused")
        over = _evidence(f, "static_range_overrun")
        assert over and over[0].suspect and LAYER in over[0].modules and f.status == "SUSPECT"
        d = next(d for d in over[0].details if d["module"] == LAYER)
        assert "onednn" in d["kernel"] and d["range"] == pytest.approx(s * 127, rel=1e-3)
        assert OUTLIER in [c["channel"] for c in d["channels_over"]]
    else:
        assert not _evidence(f, "static_range_overrun")
        unused = _evidence(f, "static_scale_unused")
        n_layers = sum(1 for k in sd if k.endswith("mlp.down_proj.input_scale"))
        # every linear vLLM holds: qkv_proj, o_proj, gate_up_proj, down_proj per decoder layer
        assert unused and not unused[0].suspect and unused[0].value == 4 * n_layers
        assert all(d["kernel"].endswith("apply_weights_sgl") for d in unused[0].details)
    from qforensics.trace import schema

    with open_trace(symmetric["files"][0]) as t:
        recs = t.records()
    inp = recs[(recs["module"] == LAYER) & (recs["io"] == schema.IO_INPUT)]
    assert len(inp) and float(inp["absmax"].max()) > 10 * s * 127  # it would have overrun
