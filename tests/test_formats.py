"""qforensics.formats against independent sources: numpy's and torch's own format limits, the
bit patterns of the FP8 formats, and every kind capture actually writes."""

from __future__ import annotations

import numpy as np
import torch

from qforensics import formats


def _fp8_max(exp_bits: int, man_bits: int, ieee_like: bool) -> float:
    bias = 2 ** (exp_bits - 1) - 1
    if ieee_like:  # e5m2: the all-ones exponent is Inf/NaN
        return (2 - 2.0 ** -man_bits) * 2.0 ** ((2 ** exp_bits - 2) - bias)
    # e4m3fn: all-ones exponent is finite except S.1111.111 (NaN)
    return (2 - 2 * 2.0 ** -man_bits) * 2.0 ** ((2 ** exp_bits - 1) - bias)


def test_float_limits_match_the_libraries():
    assert formats.FP16_MAX == float(np.finfo(np.float16).max)
    assert formats.BF16_MAX == float(torch.finfo(torch.bfloat16).max)
    assert formats.E4M3_MAX == float(torch.finfo(torch.float8_e4m3fn).max)
    assert formats.E5M2_MAX == float(torch.finfo(torch.float8_e5m2).max)
    assert formats.E4M3_MAX == _fp8_max(4, 3, ieee_like=False)
    assert formats.E5M2_MAX == _fp8_max(5, 2, ieee_like=True)
    for name, fmt in (("fp8-e4m3", torch.float8_e4m3fn), ("fp8-e5m2", torch.float8_e5m2)):
        tiny = formats.FP8_MIN_SUBNORMAL[name]
        assert float(torch.tensor(tiny).to(fmt).float()) == tiny
        assert float(torch.tensor(tiny / 2.1).to(fmt).float()) == 0.0
        assert formats.FORMAT_LIMITS[name] == float(torch.finfo(fmt).max)


def test_int_ranges():
    for bits in (2, 4, 8, 16):
        lo, hi = formats.int_range(bits)
        info = np.iinfo(f"int{bits}") if bits in (8, 16) else None
        if info is not None:
            assert (lo, hi) == (info.min, info.max)
        assert hi - lo + 1 == 2 ** bits and lo == -hi - 1
        assert formats.int_range(bits, signed=False) == (0, 2 ** bits - 1)
    assert formats.symmetric_qmax(4) == 7 and formats.symmetric_qmax(8) == 127


def test_capture_writes_only_known_kinds():
    from qforensics.hooks.modules import select_modules

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.act = torch.nn.GELU()

    model = torch.nn.Sequential(Block(), torch.nn.Linear(4, 2))
    kinds = {k for _, _, k in select_modules(model)} | {
        k for _, _, k in select_modules(model, ["0.act"])}
    assert kinds <= formats.MODULE_KINDS
    assert {formats.KIND_LINEAR, formats.KIND_ROOT, formats.KIND_OTHER} <= kinds


# -- the one table of number formats, and every place that reads a format's limit -----------------
def _expected() -> dict[str, dict[str, float]]:
    """Maxima and smallest values derived without the table: the bit patterns of the formats,
    and ml_dtypes' / torch's / numpy's own finfo."""
    import ml_dtypes

    out = {}
    for name, dt, e, m, ieee in (("fp8-e4m3", ml_dtypes.float8_e4m3fn, 4, 3, False),
                                 ("fp8-e5m2", ml_dtypes.float8_e5m2, 5, 2, True)):
        fi = ml_dtypes.finfo(dt)
        bias = 2 ** (e - 1) - 1
        assert float(fi.max) == _fp8_max(e, m, ieee)
        out[name] = {"max": _fp8_max(e, m, ieee), "min_normal": 2.0 ** (1 - bias),
                     "min_subnormal": 2.0 ** (1 - bias - m), "exponent_bits": e,
                     "mantissa_bits": m}
        assert float(fi.smallest_normal) == out[name]["min_normal"]
        assert float(fi.smallest_subnormal) == out[name]["min_subnormal"]
        assert fi.nmant == m
    for name, dt in (("fp16", np.float16), ("fp32", np.float32), ("bf16", ml_dtypes.bfloat16)):
        fi = ml_dtypes.finfo(dt) if name == "bf16" else np.finfo(dt)
        out[name] = {"max": float(fi.max), "min_normal": float(fi.smallest_normal),
                     "min_subnormal": float(fi.smallest_subnormal), "mantissa_bits": fi.nmant}
    e8m0 = ml_dtypes.finfo(ml_dtypes.float8_e8m0fnu)
    out["fp8-e8m0"] = {"max": float(e8m0.max), "min_normal": float(e8m0.smallest_normal)}
    out["int8"] = {"max": float(np.iinfo(np.int8).max)}
    out["int4"] = {"max": float(ml_dtypes.iinfo(ml_dtypes.int4).max)}
    return out


def test_the_table_matches_the_format_definitions():
    exp = _expected()
    assert set(exp) == set(formats.NUMBER_FORMATS)
    for name, want in exp.items():
        row = formats.NUMBER_FORMATS[name]
        assert row.name == name
        for key, value in want.items():
            assert getattr(row, key) == value, (name, key)
        if row.kind == "float" and name != "fp8-e8m0":
            assert row.min == -row.max and row.bits == 1 + row.exponent_bits + row.mantissa_bits
            assert float(torch.finfo(getattr(torch, row.dtype)).max) == row.max
            assert 2.0 ** row.min_exponent == row.min_normal
    assert formats.NUMBER_FORMATS["fp8-e4m3"].min_exponent == -6
    assert formats.NUMBER_FORMATS["fp8-e5m2"].min_exponent == -14


def test_every_place_reads_the_same_maximum():
    """Each module that needs a format's largest value reads the number the format defines."""
    from qforensics.analyze.views import format_limit
    from qforensics.hooks.params import static_input
    from qforensics.layouts import fp8 as lfp8
    from qforensics.layouts.torch_adapters import FP8_TORCH_DTYPES, TORCH_DTYPES
    from qforensics.quant.fp8 import FP8_FORMATS, _format
    from qforensics.scan.dtypes import FLOAT_FORMATS

    exp = _expected()
    e4m3, e5m2, fp16 = exp["fp8-e4m3"]["max"], exp["fp8-e5m2"]["max"], exp["fp16"]["max"]
    assert (e4m3, e5m2, fp16) == (448.0, 57344.0, 65504.0)
    assert formats.FORMAT_LIMITS == {"fp8-e4m3": e4m3, "fp8-e5m2": e5m2, "fp16": fp16}
    assert (formats.E4M3_MAX, formats.E5M2_MAX, formats.FP16_MAX) == (e4m3, e5m2, fp16)
    assert formats.BF16_MAX == exp["bf16"]["max"]
    assert formats.FP8_MIN_SUBNORMAL == {n: exp[n]["min_subnormal"] for n in ("fp8-e4m3", "fp8-e5m2")}
    # layouts (numpy): keyed by dtype name; the decode tables' largest finite value too
    assert lfp8.FP8_MAX == {"float8_e4m3fn": e4m3, "float8_e5m2": e5m2}
    for dt, top in lfp8.FP8_MAX.items():
        table = lfp8.FP8_DECODE[dt]
        assert float(np.nanmax(table[np.isfinite(table)])) == top
        assert float(lfp8.quantize_fp8(np.array([1e9]), dt)[0]) == top
    assert lfp8.dtype_name("fp8-e4m3fn") == lfp8.dtype_name("e4m3") == "float8_e4m3fn"
    # quant (torch): its short keys, and the FP8 rounding's clamp
    for key, top, m, emin in (("e4m3", e4m3, 3, -6), ("e5m2", e5m2, 2, -14)):
        spec = FP8_FORMATS[key]
        assert (spec.max, spec.mantissa_bits, spec.min_exponent) == (top, m, emin)
        assert spec.min_subnormal == exp[f"fp8-{key}"]["min_subnormal"]
        assert _format(f"fp8-{key}") is spec and _format(spec.torch_dtype) is spec
    assert _format("e4m3fn") is FP8_FORMATS["e4m3"]
    # scan (safetensors names)
    assert (FLOAT_FORMATS["F8_E4M3"].max, FLOAT_FORMATS["F8_E5M2"].max) == (e4m3, e5m2)
    assert (FLOAT_FORMATS["F16"].max, FLOAT_FORMATS["BF16"].max) == (fp16, exp["bf16"]["max"])
    assert FLOAT_FORMATS["F8_E4M3"].tiny == exp["fp8-e4m3"]["min_normal"]
    assert FLOAT_FORMATS["F8_E5M2"].tiny == exp["fp8-e5m2"]["min_normal"]
    assert FLOAT_FORMATS["F8_E8M0"].max == exp["fp8-e8m0"]["max"]
    # analyze's display of a scheme's limit
    assert format_limit("fp8-e4m3-nosat") == ("FP8 e4m3", e4m3)
    assert format_limit("fp8-e5m2") == ("FP8 e5m2", e5m2)
    assert format_limit("fp16") == ("FP16", fp16)
    # capture's static input range: scale x the format's max
    lin = torch.nn.Linear(4, 4)
    lin.register_buffer("input_scale", torch.tensor(0.5))
    for q, fmt, top in (({"act_format": "fp8-e4m3"}, "fp8-e4m3", e4m3),
                        ({"act_format": "e5m2"}, "fp8-e5m2", e5m2),
                        ({"format": "fp8", "weight_format": "fp8-e5m2"}, "fp8-e5m2", e5m2),
                        ({"format": "int8"}, "int8", exp["int8"]["max"])):
        st = static_input(lin, q)
        assert (st["format"], st["qmax"], st["range"]) == (fmt, top, 0.5 * top), q
    # the torch side maps the canonical names to torch's dtypes by name
    assert TORCH_DTYPES["fp8-e4m3"] is torch.float8_e4m3fn
    assert FP8_TORCH_DTYPES == (torch.float8_e4m3fn, torch.float8_e5m2)


def test_old_names_map_to_the_canonical_ones():
    cf, cl = formats.canonical_format, formats.canonical_layout
    for old in ("fp8-e4m3fn", "e4m3fn", "e4m3", "float8_e4m3fn", "torch.float8_e4m3fn", "F8_E4M3",
                "FP8-E4M3"):
        assert cf(old) == "fp8-e4m3", old
    for old in ("e5m2", "float8_e5m2", "F8_E5M2", "fp8-e5m2"):
        assert cf(old) == "fp8-e5m2", old
    assert (cf("float16"), cf("bfloat16"), cf("F32"), cf("int8")) == ("fp16", "bf16", "fp32", "int8")
    assert cf("awq") is None and cf(None) is None
    assert (cl("awq"), cl("gptq"), cl("fp8-e4m3fn"), cl("fp8-e5m2"), cl("awq-gemm")) == (
        "awq-gemm", "gptq", "fp8", "fp8", "awq-gemm")
    assert cl("fp8-e4m3-nosat") is None and cl(3) is None
    # no spelling names two formats; every alias lands on a name of the vocabulary
    seen: dict[str, str] = {}
    for f in formats.NUMBER_FORMATS.values():
        for a in {x.lower() for x in (f.name, f.dtype, f.safetensors, *f.aliases) if x}:
            assert seen.setdefault(a, f.name) == f.name, a
    assert set(formats.LAYOUT_ALIASES.values()) <= set(formats.LAYOUTS)
    # a module's quant info: capture's older words in the one vocabulary; fake quant untouched
    cq = formats.canonical_quant
    assert cq({"format": "awq", "bits": 4}) == {"format": "awq-gemm", "bits": 4}
    assert cq({"format": "fp8-e4m3fn", "bits": 8}) == {"format": "fp8", "bits": 8,
                                                        "weight_format": "fp8-e4m3"}
    assert cq({"format": "fp8-e5m2"})["weight_format"] == "fp8-e5m2"
    scheme = {"format": "fp8-e4m3", "target": "activations"}
    assert cq(scheme) is scheme
    new = {"format": "awq-gemm", "bits": 4}
    assert cq(new) is new


def test_the_detector_speaks_the_one_vocabulary():
    from qforensics.layouts.detect import FORMATS, detect

    assert FORMATS is formats.LAYOUTS
    specs = [({"qweight": {"dtype": "int32", "shape": [64, 2]},
               "scales": {"dtype": "float16", "shape": [2, 16]}}, "WQLinear_GEMM"),
             ({"weight": {"dtype": "float8_e5m2", "shape": [4, 4]}}, "Linear"),
             ({"weight": {"dtype": "bfloat16", "shape": [4, 4]}}, "Linear")]
    for params, mt in specs:
        assert detect(params, mt).name in formats.LAYOUTS
    qw = {"qweight": {"dtype": "int32", "shape": [64, 2]}}
    assert detect(qw, "QuantLinear", method="AWQ").name == "awq-gemm"


def test_capture_records_the_detectors_name():
    """quant.format of a quantized layer is the detector's layout name (also `layout`), FP8
    with the weight's element format; older traces' names read the same through the alias map."""
    import json

    from qforensics.hooks.modules import describe_module

    for dt, wf in ((torch.float8_e4m3fn, "fp8-e4m3"), (torch.float8_e5m2, "fp8-e5m2")):
        lin = torch.nn.Linear(8, 4)
        lin.weight = torch.nn.Parameter(torch.zeros(4, 8).to(dt), requires_grad=False)
        lin.register_buffer("weight_scale", torch.tensor(1.0))
        info = json.loads(describe_module("x", lin, formats.KIND_QUANTIZED_LINEAR)["info"])
        assert info["layout"] == info["quant"]["format"] == "fp8"
        assert info["quant"]["weight_format"] == wf
        old = f"fp8-{str(dt).split('_')[1]}"  # what capture wrote before: "fp8-e4m3fn"
        assert formats.canonical_quant({"format": old, "bits": 8}) == info["quant"] | {"bits": 8}


def test_analyze_reads_old_and_new_names_alike(tmp_path):
    import json
    import shutil
    from pathlib import Path

    import h5py

    from qforensics.analyze.quantization import read_quant
    from qforensics.trace.moduleinfo import read_module_infos
    from qforensics.trace.reader import open_trace

    src = Path(__file__).resolve().parents[1] / "sample_traces" / "fp8-e4m3-nosat-act.h5"
    p = tmp_path / "t.h5"
    shutil.copyfile(src, p)
    rows = [{"format": "awq", "bits": 4}, {"format": "awq-gemm", "bits": 4},
            {"format": "fp8-e4m3fn", "bits": 8},
            {"format": "fp8", "weight_format": "fp8-e4m3", "bits": 8}]
    with h5py.File(p, "r+") as f:
        info = f["modules/info"][:]
        for i, q in enumerate(rows, start=1):
            info[i] = json.dumps({"quant": q})
        f["modules/info"][:] = info
    with open_trace(p) as t:
        names = t.module_names.tolist()[1:5]
        quant, infos = read_quant(t), read_module_infos(t)
    assert [quant[n].format for n in names] == ["awq-gemm", "awq-gemm", "fp8", "fp8"]
    assert infos.quant[names[0]] == infos.quant[names[1]]
    assert infos.quant[names[2]] == infos.quant[names[3]]
