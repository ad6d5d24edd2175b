"""The report's first sentence never contradicts its evidence, and never blames an outlier when
the producer's own parameters are corrupt."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import h5py
import pytest
import torch

import qforensics
from qforensics.analyze import analyze_trace
from qforensics.analyze.quantization import read_quant
from qforensics.reports import facts, narrative, recommendations
from qforensics.trace.reader import open_trace

_spec = importlib.util.spec_from_file_location(  # the small models of tests/hooks, by path:
    "qf_test_capture_models", Path(__file__).resolve().parents[1] / "hooks" / "capture_models.py")
_models = importlib.util.module_from_spec(_spec)  # (no sys.path change: conftest names clash)
_spec.loader.exec_module(_models)  # type: ignore[union-attr]
Tiny, ids = _models.Tiny, _models.ids

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"


def _chain(path) -> tuple[str, object]:
    f = analyze_trace(path)
    with open_trace(path) as t:
        segs = narrative.causal_chain(f, read_quant(t), facts.health_from_findings(f),
                                      facts.read_outcome(t.meta), {})
    return "".join(s.text for s in segs), f


@pytest.mark.parametrize("name", ["fp16-reference", "int4-g128-weights", "int4-per-tensor-weights",
                                  "int4-per-tensor-act", "fp8-e4m3-nosat-act"])
def test_first_sentence_agrees_with_the_verdict(name, tmp_path):
    path = tmp_path / "t.h5"
    shutil.copy(SAMPLES / f"{name}.h5", path)
    with h5py.File(path, "r+") as h:  # judge the trace alone, not the demo's metadata
        del h["meta"].attrs["outcome"]
    text, f = _chain(path)
    first = text.split(". ")[0]
    if f.status == "PASSED":
        assert first.startswith("No NaN or Inf and no sign of damage")
    elif f.status == "SUSPECT":
        lead = next(e for e in f.evidence if e.suspect)
        assert first.startswith("No NaN or Inf in") and "looks broken" in first
        assert lead.line[:40] in text
    else:
        assert first.startswith("At step") and "NaN" in first


def test_corrupt_producer_is_never_blamed_on_an_outlier(tmp_path):
    m = Tiny()
    with torch.no_grad():
        m.emb.weight[1, 5] = 9000.0  # an outlier the old story would have blamed
        m.layers[1].down.weight[6, 3] = float("nan")
    with qforensics.capture(m, str(tmp_path / "c.h5")), torch.no_grad():
        m(ids())
    text, f = _chain(tmp_path / "c.h5")
    assert f.cause.kind == "corrupted_parameters"
    assert "The cause is corrupted parameters, not the input: layers.1.down.weight: 1 NaN" in text
    assert "row 6, column 3" in text
    assert "outside the rest" not in text and "would wreck" not in text


def test_corrupt_producer_recommendations_replace_the_tensor(tmp_path):
    m = Tiny()
    with torch.no_grad():
        m.layers[0].up.weight[2, 1] = float("inf")
    with qforensics.capture(m, str(tmp_path / "c.h5")), torch.no_grad():
        m(ids())
    f = analyze_trace(tmp_path / "c.h5")
    with open_trace(tmp_path / "c.h5") as t:
        recs = recommendations.recommendations(f, read_quant(t), facts.health_from_findings(f),
                                         facts.read_outcome(t.meta), {}, trace_arg="c.h5")
    ids_ = [r.id for r in recs]
    assert ids_[0] == "rec-params" and "rec-group" not in ids_ and "rec-salient" not in ids_
    assert "layers.0.up.weight: 1 Inf, first at row 2, column 1" in "".join(
        s.text for s in recs[0].why)
