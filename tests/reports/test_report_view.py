"""What the analysis hands the report (qforensics.analyze.views), checked against what the
synthetic writer planted: the producer's two outlier channels, the INT4 per-tensor scale they
set, the heat-map cell of the first NaN, the logits of every step, one score per module."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from synth import INNER, OUTLIERS, bad_module_index, write_synthetic_trace

from qforensics.analyze import analyze_trace
from qforensics.analyze.findings import DiffFindings, Divergence, Verdict
from qforensics.analyze.views import divergence_series, format_limit, open_report_view
from qforensics.formats import FORMAT_LIMITS


@pytest.fixture(scope="module")
def failing(tmp_path_factory):
    path = write_synthetic_trace(tmp_path_factory.mktemp("view") / "fail.h5")
    return path, open_report_view(path)


def test_channels_are_the_producers_input(failing):
    _, (f, _, view) = failing
    ch = view.channels
    assert ch.why == "producer" and ch.module == "model.layers.1.mlp.down_proj"
    assert ch.absmax.shape == (INNER,) and ch.step == 0
    assert [c for c, _ in ch.labelled] == sorted(OUTLIERS, key=lambda c: -OUTLIERS[c])
    assert [v for _, v in ch.labelled] == pytest.approx(sorted(OUTLIERS.values(), reverse=True))
    # per-tensor INT4: scale = absmax / 7; every planted channel but the two lies below half
    assert ch.int4_half_scale == pytest.approx(max(OUTLIERS.values()) / 7 / 2, rel=1e-6)
    assert ch.int4_zeroed == INNER - len(OUTLIERS)
    assert ch.limit == ("FP8 e4m3", FORMAT_LIMITS["fp8-e4m3"])  # the module records fp8-e4m3


def test_without_outlier_findings_the_analysis_rule_labels(failing):
    """Findings naming no outlier: the view labels what the analyzer's own rule flags."""
    path, (f, _, _) = failing
    _, _, view = open_report_view(path, findings=dataclasses.replace(f, outliers=[]))
    assert sorted(c for c, _ in view.channels.labelled) == sorted(OUTLIERS)


def test_heatmap_marks_the_first_nan(failing):
    _, (f, _, view) = failing
    hm = view.heatmap
    n_modules = 4 * 4 + 1
    assert (hm.n_modules, hm.n_steps) == (n_modules, 6) and not hm.binned
    assert hm.mark == (bad_module_index(), 0)  # rows in call order: module index = row
    assert hm.bad[bad_module_index(), 0] and not hm.bad[:bad_module_index(), 0].any()


def test_logits_series_covers_every_step(tmp_path):
    ok = write_synthetic_trace(tmp_path / "ok.h5", fail=False, seed=2)
    _, _, view = open_report_view(ok)
    s = view.logits
    assert s.steps.tolist() == list(range(6)) and not s.nonfinite.any()
    assert s.lmin.tolist() == [-10 - i for i in range(6)]
    assert s.lmax.tolist() == [20 + i for i in range(6)] and s.first_bad_step is None


def test_failing_logits_name_the_first_bad_step(failing):
    _, (_, _, view) = failing
    assert view.logits.nonfinite.all() and view.logits.first_bad_step == 0


def test_divergence_keeps_each_modules_largest_score():
    def div(module, call, score, nonfinite=False):
        return Divergence(module=module, step=0, io=1, slot=0, call_index=call,
                          suspect_call_index=call, rel_absmax=0.0, rel_std=0.0, rel_mean=0.0,
                          channel_div=0.0, sqnr_db=None, cosine=None, score=score, jump=0.0,
                          nonfinite=nonfinite)

    ranked = [div("b", 3, 0.5), div("a", 1, 0.1), div("b", 2, 0.9), div("c", 5, float("nan"),
                                                                       True)]
    d = DiffFindings(reference="r.h5", suspect="s.h5", verdict=Verdict("FAILED", "x"),
                     n_aligned=4, n_only_reference=0, n_only_suspect=0, steps_compared=[0],
                     first_jump=ranked[0], ranked=ranked)
    s = divergence_series(d)
    assert s.modules == ["a", "b", "c"] and s.first_jump == 1 and s.step == 0
    assert s.scores.tolist() == [0.1, 0.9, float("inf")]
    assert s.nonfinite.tolist() == [False, False, True]


@pytest.mark.parametrize("fmt, name", [("fp8-e5m2", "FP8 e5m2"), ("fp16", "FP16"),
                                       ("int4-per-tensor", "FP8 e4m3"), (None, "FP8 e4m3")])
def test_format_limit(fmt, name):
    got = format_limit(fmt)
    assert got[0] == name
    assert got[1] == {"FP8 e5m2": 57344.0, "FP16": 65504.0, "FP8 e4m3": 448.0}[name]


def test_open_report_view_analyzes_like_analyze_trace(tmp_path):
    """The findings `open_report_view` makes are the analyzer's own; the metadata is the
    trace's."""
    path = write_synthetic_trace(tmp_path / "t.h5", n_layers=2, seed=4)
    f, _, view = open_report_view(path)
    g = analyze_trace(path)
    assert f.verdict == g.verdict and [o.channel for o in f.outliers] == [o.channel
                                                                          for o in g.outliers]
    assert view.meta["environment"]["scenario"] == "synthetic"
    assert np.isfinite(view.channels.absmax).all()


def test_reports_never_read_a_trace_themselves():
    """reports/ presents the analysis: no module of it imports the trace reader, the schema,
    the block decoders or h5py (parsing helpers of qforensics.trace.validate are allowed)."""
    import ast
    from pathlib import Path

    import qforensics.reports

    forbidden = {"qforensics.trace.reader", "qforensics.trace.schema", "qforensics.trace.blocks",
                 "qforensics.trace.table", "h5py"}
    found = []
    for path in Path(qforensics.reports.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            found += [f"{path.name}: {n}" for n in names if n in forbidden]
    assert found == []
