"""Silent failures read from the trace alone: the committed SmolLM2 traces with the demo's
outcome metadata removed (so top-1 agreement with the reference is not available), and the
healthy ones stay PASSED."""

from __future__ import annotations

import shutil

import h5py
import numpy as np
import pytest

from qforensics.analyze import PASSED, SUSPECT, analyze_trace


def _without_outcome(src: str, dst) -> str:
    shutil.copy(src, dst)
    with h5py.File(dst, "r+") as f:
        del f["meta"].attrs["outcome"]
    return str(dst)


def test_per_tensor_int4_weights_suspect_from_parameters(sample, tmp_path):
    path = _without_outcome(sample("int4-per-tensor-weights"), tmp_path / "w.h5")
    f = analyze_trace(path)
    assert f.status == SUSPECT and f.exit_code == 1
    ev = {e.kind: e for e in f.evidence}
    assert "outcome" not in ev
    zero = ev["parameters_mostly_zero"]
    # independent: count the module info rows whose weight is more than half zeros
    import json
    with h5py.File(path, "r") as h:
        infos = [json.loads(x) for x in h["modules/info"][:]]
    n = sum(1 for i in infos if i.get("health", {}).get("weight", {}).get("numel")
            and i["health"]["weight"]["zero"] > 0.5 * i["health"]["weight"]["numel"])
    assert n > 100 and zero.value == n
    assert f.verdict.line.startswith(f"SUSPECT | no NaN, but {n} weight tensors are more than 50%")


def test_per_tensor_int4_activations_suspect_from_recorded_scheme(sample, tmp_path):
    f = analyze_trace(_without_outcome(sample("int4-per-tensor-act"), tmp_path / "a.h5"))
    assert f.status == SUSPECT
    ev = {e.kind: e for e in f.evidence}["activation_scheme_zeroes"]
    assert ev.details[0]["module"] == "model.layers.11.mlp.down_proj"
    # independent: channels below half the per-tensor INT4 step of that module's input
    with h5py.File(tmp_path / "a.h5", "r") as h:
        rec = h["records"]
        mods = [m.decode() if isinstance(m, bytes) else m for m in h["modules/name"][:]]
        mid = mods.index("model.layers.11.mlp.down_proj")
        i = np.nonzero((rec["module_id"][:] == mid) & (rec["io"][:] == 0)
                       & (rec["step"][:] == f.damage_step))[0][0]
        off, c = int(rec["chan_offset"][i]), int(rec["channels"][i])
        a = np.maximum(np.abs(h["channels/min"][off:off + c].astype(np.float64)),
                       np.abs(h["channels/max"][off:off + c].astype(np.float64)))
    zeroed = int(np.sum(a < a.max() / 7 / 2))
    assert ev.details[0]["channels_zeroed"] == zeroed and zeroed > 0.9 * c


@pytest.mark.parametrize("name", ["fp16-reference", "int4-g128-weights", "int4-g128-salient1pct"])
def test_healthy_samples_stay_passed(sample, tmp_path, name):
    f = analyze_trace(_without_outcome(sample(name), tmp_path / "h.h5"))
    assert f.status == PASSED, f.verdict.line
    assert [e for e in f.evidence if e.suspect] == []


def test_thresholds_and_rationale_in_json(sample):
    d = analyze_trace(sample("fp16-reference")).to_dict()
    for k in ("param_zero_share", "param_levels", "param_dominated", "static_overrun",
              "degenerate_steps"):
        assert k in d["thresholds"] and d["thresholds_rationale"][k]
    assert d["tied"] == [] or all(len(g) > 1 for g in d["tied"])
