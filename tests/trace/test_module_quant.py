"""read_module_quant (only the `quant` of each module's info) agrees with read_module_infos."""

from __future__ import annotations

import json
import shutil

import h5py
from hostile import SAMPLES

from qforensics.trace.moduleinfo import read_module_infos, read_module_quant
from qforensics.trace.reader import open_trace


def test_quant_alone_matches_the_full_parse(tmp_path):
    for p in sorted(SAMPLES.glob("*.h5")):
        with open_trace(p) as t:
            assert read_module_quant(t) == read_module_infos(t).quant, p
    # malformed and hostile values are dropped the same way
    p = tmp_path / "t.h5"
    shutil.copyfile(SAMPLES / "fp8-e4m3-nosat-act.h5", p)
    with h5py.File(p, "r+") as f:
        info = f["modules/info"][:]
        info[1] = b"{not json"
        info[2] = json.dumps({"quant": {"format": "x" * 500, "bits": 4, "nested": {"a": 1}}})
        info[3] = json.dumps({"quant": ["not", "a", "dict"]})
        f["modules/info"][:] = info
    with open_trace(p) as t:
        q = read_module_quant(t)
        assert q == read_module_infos(t).quant
        names = t.module_names.tolist()
    assert q[names[2]] == {"bits": 4} and names[1] not in q and names[3] not in q


def test_layouts_are_named_by_the_one_detector(tmp_path):
    """Each module's weight layout comes from its recorded tensors (dtype, shape), in the
    detector's spelling; capture's "gptq" for a non-AutoAWQ qweight layer is not trusted."""
    from qforensics.analyze.quantization import read_quant
    from qforensics.layouts import FORMATS

    p = tmp_path / "t.h5"
    shutil.copyfile(SAMPLES / "fp8-e4m3-nosat-act.h5", p)
    awq = {"qweight": {"dtype": "int32", "shape": [64, 2]}, "qzeros": {"dtype": "int32", "shape": [2, 2]},
           "scales": {"dtype": "float16", "shape": [2, 16]}}
    fp8 = {"weight": {"dtype": "float8_e4m3fn", "shape": [16, 64]}, "weight_scale": {"dtype": "float32", "shape": []}}
    with h5py.File(p, "r+") as f:
        info = f["modules/info"][:]
        info[1] = json.dumps({"params": awq, "quant": {"format": "gptq", "bits": 4}})
        info[2] = json.dumps({"params": fp8, "quant": {"format": "fp8-e4m3", "bits": 8}})
        info[3] = json.dumps({"params": {"weight": {"dtype": "float16", "shape": [4, 4]}}})
        f["modules/info"][:] = info
    with open_trace(p) as t:
        infos = read_module_infos(t)
        quant = read_quant(t)
        names = t.module_names.tolist()
    assert [infos.layouts.get(n) for n in names[1:4]] == ["awq-gemm", "fp8", "dense"]
    assert set(infos.layouts.values()) <= set(FORMATS)
    assert quant[names[1]].layout == "awq-gemm" and quant[names[2]].layout == "fp8"
    assert quant[names[2]].format == "fp8"  # capture's older words read in the one vocabulary
    assert infos.quant[names[2]]["weight_format"] == "fp8-e4m3"


def test_the_layout_capture_recorded_is_taken_and_a_bad_one_ignored(tmp_path):
    from qforensics.layouts import FORMATS

    p = tmp_path / "t.h5"
    shutil.copyfile(SAMPLES / "fp8-e4m3-nosat-act.h5", p)
    fp8 = {"weight": {"dtype": "float8_e4m3fn", "shape": [16, 64]}}
    with h5py.File(p, "r+") as f:
        info = f["modules/info"][:]
        info[1] = json.dumps({"layout": "vllm-cpu-w4a16", "params": {}})  # the live detector's
        info[2] = json.dumps({"layout": "<script>", "params": fp8})  # not a layout name
        f["modules/info"][:] = info
    with open_trace(p) as t:
        infos = read_module_infos(t)
        names = t.module_names.tolist()
    assert "vllm-cpu-w4a16" in FORMATS and "<script>" not in FORMATS
    assert infos.layouts.get(names[1]) == "vllm-cpu-w4a16"
    assert infos.layouts.get(names[2]) == "fp8"  # detected from the recorded tensors instead
