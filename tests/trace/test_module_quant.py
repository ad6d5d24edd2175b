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
