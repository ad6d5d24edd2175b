"""The module info JSON is untrusted: malformed health / static-input / tied values are dropped
and counted, never trusted or crashed on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py

from qforensics.analyze import analyze_trace
from qforensics.trace.moduleinfo import read_module_infos
from qforensics.trace.reader import open_trace

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"

BAD = [
    {"health": {"weight": {"numel": -5, "nan": 1}}},  # negative numel
    {"health": {"weight": {"numel": 10, "nan": 11}}},  # more NaN than values
    {"health": {"weight": {"numel": 10, "nan": 1, "first_nonfinite": {"index": 10 ** 30,
                                                                      "row": 0}}}},
    {"health": {"weight": {"numel": 10, "nan": "1"}}},  # a string count
    {"health": {"weight": {"numel": 10, "levels": {"group_size": 4, "groups": 1,
                                                   "rows_sampled": 1, "levels_min": 1,
                                                   "levels_median": "NaN",
                                                   "dominated_share": 7}}}},
    {"static_input": {"scale": "big", "range": 1}},
    {"static_input": {"scale": 0.0, "scale_min": 0.0, "qmax": 448, "range": 0.0,
                      "format": "fp8-e4m3"}},
    {"static_input": {"scale": 0.1, "scale_min": 0.1, "qmax": 127, "range": 12.7,
                      "format": "int8", "lo": 1.0, "hi": 12.7}},  # lo above zero
    {"static_input": {"scale": 0.1, "scale_min": 0.1, "qmax": 127, "range": 12.7,
                      "format": "int8", "applied": "no"}},  # not a bool
    [1, 2, 3],  # not an object
]


def test_malformed_module_info_is_dropped_and_counted(tmp_path):
    path = tmp_path / "bad.h5"
    shutil.copy(SAMPLES / "fp16-reference.h5", path)
    with h5py.File(path, "r+") as h:
        info = h["modules/info"]
        for i, v in enumerate(BAD):
            info[i + 1] = json.dumps(v)
        info[0] = "{not json"
        root = len(info) - 1
        info[root] = json.dumps({"tied": [["a.weight", 5], "x", ["b.weight", "c.weight"]]})
    with open_trace(path) as t:
        mi = read_module_infos(t)
    # whole values dropped: negative numel, NaN > numel, string count, four bad static_input, a
    # list, the broken JSON; a bad index or levels summary is dropped inside a row that is kept
    assert mi.invalid == 9
    bad_idx = [h for h in mi.health if h.numel == 10]
    assert len(bad_idx) == 2  # the out-of-range index and the bad levels are dropped, not the row
    assert all(h.first_nonfinite is None and h.levels is None for h in bad_idx)
    assert mi.tied == [["b.weight", "c.weight"]]
    f = analyze_trace(path)  # still analyzes
    assert any("malformed module info" in n for n in f.notes)
