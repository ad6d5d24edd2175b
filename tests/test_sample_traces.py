"""The committed sample traces: small enough, documented, and readable by this version."""

from __future__ import annotations

from pathlib import Path

import qforensics

HERE = Path(__file__).resolve().parents[1] / "sample_traces"
NAMES = ["fp16-reference", "fp8-e4m3-nosat-act", "int4-per-tensor-weights",
         "int4-per-tensor-act", "int8-per-tensor-act", "int4-g128-weights",
         "int4-g128-salient1pct", "fp8-e4m3-static-act", "fp8-e4m3-static-lowscale-act",
         "corrupt-weight-nan-row"]


def test_sizes_and_readme():
    sizes = {n: (HERE / f"{n}.h5").stat().st_size for n in NAMES}
    assert all(s <= 5 * 10**6 for s in sizes.values()), sizes
    assert sum(sizes.values()) <= 20 * 10**6
    readme = (HERE / "README.md").read_text()
    for n in NAMES:
        assert f"{n}.h5" in readme


def test_each_sample_opens_and_carries_its_outcome():
    for n in NAMES:
        with qforensics.open_trace(HERE / f"{n}.h5") as t:
            assert t.end.complete
            oc = t.meta["outcome"]
            assert oc["scenario"] == n and oc["text"]
            assert t.meta["environment"]["scenario"] == n
            assert t.n_steps >= 8
            nonfinite = (t.steps.first_nonfinite_call >= 0).any()
            assert nonfinite == (n in ("fp8-e4m3-nosat-act", "corrupt-weight-nan-row"))
