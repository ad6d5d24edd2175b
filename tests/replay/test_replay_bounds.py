"""Per-kernel error bounds (qforensics/replay/bounds.py): the recorded healthy FP8 tile of the
2026-12-04 H200 run reads NOT REPRODUCED under torch._scaled_mm's own bound, every kernel still
catches a planted divergence, and a kernel without a stated bound is never KERNEL DIVERGES.

No GPU here. The CPU kernels are the real torch ops (torch._scaled_mm has a CPU float8
implementation in this torch; _weight_int4pack_mm_for_cpu; Inductor's C++ for torch.compile).
Hopper's FP8 tensor-core accumulation cannot run on a CPU: `hopper_fp8_emulation` follows the
arithmetic the CUDA bound models (14 significant bits, truncated, promoted to fp32 every 128) and
is used to test that bound, not to stand in for a GPU measurement."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from replay_helpers import make_awq

from qforensics.layouts.fp8 import decode_fp8
from qforensics.replay.bounds import BoundModel, model_for
from qforensics.replay.build import build_bundle
from qforensics.replay.gpu_check import tile_bundles
from qforensics.replay.judge import judge_numeric
from qforensics.replay.torch_kernels import KERNELS
from qforensics.replay.verdict import Verdict

REPO = Path(__file__).resolve().parents[2]
FIX = Path(__file__).parent / "fixtures" / "gpu-h200-2026-12-04"
SAMPLE = REPO / "sample_traces" / "fp8-e4m3-nosat-act.h5"


@pytest.fixture(scope="module")
def fp8_tile():
    return tile_bundles(SAMPLE)["fp8"]


def _recorded_scaled_mm() -> dict:
    """The numeric leg of torch_scaled_mm in the copied summary.json, and the numbers its line states."""
    res = json.loads((FIX / "summary.json").read_text())["cases"]["torch_scaled_mm"]["results"][0]
    m = re.search(r"worst at \[(\d+), (\d+)\]: \|err\| ([\d.e+-]+) > ([\d.e+-]+)", res["summary"])
    old = re.search(r"<= ([\d.e+-]+) \* sum_k", res["details"]["tolerance"])
    assert m and old, res["summary"]
    return {"verdict": res["verdict"], "at": (int(m[1]), int(m[2])), "worst_err": float(m[3]),
            "worst_old_tol": float(m[4]), "old_coef": float(old[1]), "max_ratio": res["details"]["max_err_over_tolerance"],
            "max_abs_err": res["details"]["max_abs_err"], "diverging": res["details"]["diverging"],
            "compared": res["details"]["compared"]}


def _s(b):
    x = b.layout.effective_input(b.tensors["x"], b.tensors, b.meta)
    w = b.layout.weight_kn(b.tensors, b.meta)
    return np.abs(x) @ np.abs(w), x @ w


def test_recorded_fp8_tile_is_not_reproduced_under_the_hopper_bound(fp8_tile):
    rec = _recorded_scaled_mm()
    assert rec["verdict"] == "KERNEL DIVERGES" and (rec["diverging"], rec["compared"]) == (1937, 2752)
    s, ref = _s(fp8_tile)
    old_tol = rec["old_coef"] * s
    r, c = rec["at"]
    # the same tile: the old bound rebuilt here is the one the run printed at its worst output
    assert old_tol[r, c] == pytest.approx(rec["worst_old_tol"], rel=2e-3)
    model, why = model_for("torch-scaled-mm", "cuda", fp8_tile.meta)
    assert model is not None, why
    new_tol = model.evaluate(s, ref, 1536)
    assert new_tol[r, c] > rec["worst_err"] * 10
    # every output's recorded error is at most max_ratio x its old bound: all lie within the new one
    worst_allowed = rec["max_ratio"] * old_tol
    assert (worst_allowed < new_tol).all()
    # a kernel output with that worst recorded error at every output, either sign, reads NOT REPRODUCED
    sign = np.where(np.arange(ref.size).reshape(ref.shape) % 2, 1.0, -1.0)
    res = judge_numeric(fp8_tile, ref + sign * worst_allowed, "torch-scaled-mm (CUDA)", kernel="torch-scaled-mm",
                        device="cuda")
    assert res.verdict is Verdict.NOT_REPRODUCED, res.line()
    doc = res.to_dict()
    assert doc["bound_model"]["name"] == "fp8-tensor-core-14bit-promote128"
    assert "bound model fp8-tensor-core-14bit-promote128" in res.summary and "14 bits" in doc["bound_model"]["basis"]


def _trunc(v: np.ndarray, bits: int) -> np.ndarray:
    m, e = np.frexp(v)
    return np.ldexp(np.trunc(m * 2.0 ** bits) / 2.0 ** bits, e)


def hopper_fp8_emulation(b, *, chunk=128, bits=14, weight_scale=None, x=None, weight=None, k_stop=None):
    """CPU emulation of torch._scaled_mm's arithmetic on Hopper: exact e4m3 products summed with
    `bits` significant bits (truncated) in chunks of `chunk`, chunk sums in fp32, the fp32 scale
    epilogue, fp32 output. Keyword overrides plant a bug (a scale, an operand, a dropped K tail)."""
    from qforensics.replay.torch_kernels import scaled_operands

    xq, sa, sb = scaled_operands(b.tensors, b.meta)
    xq = xq if x is None else x
    wq = decode_fp8(np.asarray(b.tensors["weight"] if weight is None else weight), "float8_e4m3fn").T
    sb = sb if weight_scale is None else weight_scale
    k = xq.shape[1] if k_stop is None else k_stop
    acc = np.zeros((xq.shape[0], wq.shape[1]), np.float32)
    for c0 in range(0, k, chunk):
        part = np.zeros(acc.shape)
        for i in range(c0, min(k, c0 + chunk)):
            part = _trunc(part + np.outer(xq[:, i], wq[i]), bits)
        acc = acc + part.astype(np.float32)
    alpha = np.float32(sa) * np.float32(sb)
    return (acc * alpha).astype(np.float64)


def test_hopper_emulation_of_the_recorded_tile_is_within_its_bound(fp8_tile):
    for chunk in (128, 1536):  # promoted every 128, and no promotion at all (fast accumulation)
        y = hopper_fp8_emulation(fp8_tile, chunk=chunk)
        res = judge_numeric(fp8_tile, y, "torch-scaled-mm (CUDA)", kernel="torch-scaled-mm", device="cuda")
        assert res.verdict is Verdict.NOT_REPRODUCED, (chunk, res.line())
        # and the fp32-accumulation bound the old code used would have blamed it
        cpu = judge_numeric(fp8_tile, y, "torch-scaled-mm", kernel="torch-scaled-mm", device="cpu")
        assert cpu.verdict is Verdict.KERNEL_DIVERGES


def _fp8_plants(b):
    x = b.layout.effective_input(b.tensors["x"], b.tensors, b.meta)
    k_big = int(np.argmax(np.abs(x).max(axis=0)))
    flipped = np.array(b.tensors["weight"]).copy()
    flipped[5, k_big] ^= 0x40  # one e4m3 byte's top exponent bit: weight [n=5, k] off by 2**8
    sb = float(np.asarray(b.tensors["weight_scale"]).reshape(-1)[0])
    return {"wrong scale": {"weight_scale": 2 * sb}, "flipped weight bit": {"weight": flipped},
            "dropped K tail": {"k_stop": int(b.meta["K"]) - 128}}


@pytest.mark.parametrize("plant", ["wrong scale", "flipped weight bit", "dropped K tail"])
def test_hopper_bound_still_catches_planted_divergences(fp8_tile, plant):
    y = hopper_fp8_emulation(fp8_tile, **_fp8_plants(fp8_tile)[plant])
    res = judge_numeric(fp8_tile, y, "torch-scaled-mm (CUDA)", kernel="torch-scaled-mm", device="cuda")
    assert res.verdict is Verdict.KERNEL_DIVERGES, (plant, res.line())
    assert "bound model fp8-tensor-core" in res.summary


def _fp8_bundle(b, **over):
    t = {"input.0": np.asarray(b.tensors["x"]), "weight": np.asarray(b.tensors["weight"]),
         "weight_scale": np.asarray(b.tensors["weight_scale"]), "input_scale": np.asarray(b.tensors["input_scale"])}
    t.update(over)
    meta = {k: b.meta[k] for k in ("call_index", "module", "layout", "weight_dtype", "kernel")}
    return build_bundle(t, meta)


def test_cpu_scaled_mm_real_kernel_agrees_and_catches_plants(fp8_tile):
    kern = KERNELS["torch-scaled-mm"]
    ok, why = kern.can_run(fp8_tile.tensors, fp8_tile.meta, fp8_tile.layout)
    assert ok, why
    y = kern.run(fp8_tile.tensors, fp8_tile.meta, fp8_tile.layout)
    res = judge_numeric(fp8_tile, y, "torch-scaled-mm")
    assert res.verdict is Verdict.NOT_REPRODUCED, res.line()
    assert res.bound_model["name"] == "fp8-upcast-fp32"
    x = np.array(fp8_tile.tensors["x"])
    x_tail = x.copy()
    x_tail[:, -32:] = 0  # the kernel skipping the last K block
    plants = {"wrong scale": {"weight_scale": np.asarray(fp8_tile.tensors["weight_scale"]) * 1.01},
              "flipped weight bit": {"weight": _fp8_plants(fp8_tile)["flipped weight bit"]["weight"]},
              "dropped K tail": {"input.0": x_tail}}
    for plant, over in plants.items():
        bad = _fp8_bundle(fp8_tile, **over)
        yb = kern.run(bad.tensors, bad.meta, bad.layout)
        res = judge_numeric(fp8_tile, yb, "torch-scaled-mm")
        assert res.verdict is Verdict.KERNEL_DIVERGES, (plant, res.line())


K, N, G = 256, 64, 64


def _int4_plants(snap):
    x = np.asarray(snap["input.0"], np.float64)
    k_big = int(np.argmax(np.abs(x).max(axis=0)))
    scales = snap["scales"].copy()
    scales[1, 7] = scales[1, 7] * 2  # one wrong group scale: group 1, column 7
    qweight = snap["qweight"].copy()
    qweight[k_big, 3] ^= np.int32(0x8 << 8)  # one flipped nibble (its top bit) in input row k_big
    x_tail = snap["input.0"].copy()
    x_tail[:, -G:] = 0  # the last K group never accumulated
    return {"wrong group scale": {"scales": scales}, "flipped nibble": {"qweight": qweight},
            "dropped K tail": {"input.0": x_tail}}


@pytest.mark.parametrize("kernel", ["torch-int4pack", "torch-compile"])
def test_int4_kernels_catch_planted_divergences(kernel):
    snap = make_awq(8, N, K, G, seed=3)
    b = build_bundle(snap, {"group_size": G})
    kern = KERNELS[kernel]
    res = judge_numeric(b, kern.run(b.tensors, b.meta, b.layout), kernel)
    assert res.verdict is Verdict.NOT_REPRODUCED, res.line()
    assert res.bound_model["kernel"] == kernel and res.to_dict()["bound_model"]["statement"] in res.summary
    for plant, over in _int4_plants(snap).items():
        bad = build_bundle({**snap, **over}, {"group_size": G})
        res = judge_numeric(b, kern.run(bad.tensors, bad.meta, bad.layout), kernel)
        assert res.verdict is Verdict.KERNEL_DIVERGES, (kernel, plant, res.line())


def test_linear_catches_a_dropped_k_tail():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 256)).astype(np.float32)
    w = rng.standard_normal((32, 256)).astype(np.float32)
    b = build_bundle({"input.0": x, "weight": w}, {"compute_dtype": "float32"})
    kern = KERNELS["torch-linear"]
    assert judge_numeric(b, kern.run(b.tensors, b.meta, b.layout), "torch-linear").verdict is Verdict.NOT_REPRODUCED
    xt = x.copy()
    xt[:, -16:] = 0
    bad = build_bundle({"input.0": xt, "weight": w}, {"compute_dtype": "float32"})
    assert judge_numeric(b, kern.run(bad.tensors, bad.meta, bad.layout), "torch-linear").verdict is Verdict.KERNEL_DIVERGES


def test_a_kernel_without_a_stated_bound_is_inconclusive_never_diverges(fp8_tile):
    s, ref = _s(fp8_tile)
    y = ref + 1.0  # far off everywhere
    for name, kw in (("mylib.ops:fp8_gemm", {}), ("torch-scaled-mm (CUDA)", {"bound": None})):
        res = judge_numeric(fp8_tile, y, name, path="launcher", **kw)
        assert res.verdict is Verdict.INCONCLUSIVE and res.reason == "no stated error bound", res.line()
        assert res.bound_model is None and res.details["max_abs_err"] == pytest.approx(1.0)
        assert "not judged" in res.summary
    y_nan = ref.copy()
    y_nan[0, 0] = np.nan
    assert judge_numeric(fp8_tile, y_nan, "mylib.ops:fp8_gemm").verdict is Verdict.INCONCLUSIVE
    # a bound model that gives no finite bound (fast accumulation over a K too long) is no bound either
    fast = BoundModel.from_spec({"accumulate": "fp8-tensor-core", "output": "float32"}, kernel="k")
    long = build_bundle({"input.0": np.ones((2, 8192), np.float32), "weight": np.ones((16, 8192), np.float32)}, {})
    res = judge_numeric(long, np.full((2, 16), 8192.0), "k", bound=fast)
    assert res.verdict is Verdict.INCONCLUSIVE and "no bound at K=8192" in res.summary


def test_stated_launcher_bounds_are_checked():
    assert BoundModel.from_spec("float32", kernel="k").out == "float32"
    for bad in ({"accumulate": "float13"}, {"colour": "red"}, 3):
        with pytest.raises(ValueError):
            BoundModel.from_spec(bad, kernel="k")


def test_every_torch_kernel_states_a_bound_on_cpu_and_cuda():
    for name in KERNELS:
        for dev in ("cpu", "cuda"):
            model, why = model_for(name, dev, {"K": 1536, "compute_dtype": "float32", "N": 64},
                                   x_stored="float16", w_stored="float32")
            assert model is not None, (name, dev, why)
            a, b, eta = model.coefficients(1536)
            assert 0 < a < 0.05 and 0 <= b < 0.01, (name, dev, a, b)
    # fp16 on CUDA with torch's default reduced-precision split-K reduction: no stated bound, and why
    model, why = model_for("torch-linear", "cuda", {"K": 64, "compute_dtype": "float16"})
    if model is None:
        assert "reduced_precision_reduction" in why
