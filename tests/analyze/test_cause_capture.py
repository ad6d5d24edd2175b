"""The cause in the verdict, on traces captured from small torch models the test breaks itself:
the row or group it corrupts is the one the analysis must name; the overflow it provokes is the
one it must classify. The narrative never blames an outlier when the producer's parameters are
corrupt."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from torch import nn

import qforensics
from qforensics.analyze import FAILED, PASSED, SUSPECT, analyze_trace

_spec = importlib.util.spec_from_file_location(  # the small models of tests/hooks, by path:
    "qf_test_capture_models", Path(__file__).resolve().parents[1] / "hooks" / "capture_models.py")
_models = importlib.util.module_from_spec(_spec)  # (no sys.path change: conftest names clash)
_spec.loader.exec_module(_models)  # type: ignore[union-attr]
Tiny, ids = _models.Tiny, _models.ids


def _run(model: nn.Module, path, x: torch.Tensor, steps: int = 1) -> None:
    with qforensics.capture(model, str(path)), torch.no_grad():
        for _ in range(steps):
            model(x)


def test_nan_weight_row_is_the_cause_even_with_an_outlier_in_the_input(tmp_path):
    m = Tiny()
    with torch.no_grad():
        m.emb.weight[1, 5] = 9000.0  # a massive activation: the producer sees inputs > 448
        m.layers[1].down.weight[6, 3] = float("nan")  # the real cause, row 6
    _run(m, tmp_path / "t.h5", ids())
    f = analyze_trace(tmp_path / "t.h5")
    assert f.status == FAILED
    assert f.first_nonfinite.producer == "layers.1.down"
    assert any("fp8-e4m3" in o.limits for o in f.outliers if o.module == "layers.1.down")
    c = f.cause
    assert c.kind == "corrupted_parameters" and c.module == "layers.1.down"
    assert c.tensors[0]["param"] == "weight" and c.tensors[0]["row"] == 6
    assert "row 6, column 3" in f.verdict.line
    assert any(e.kind == "parameters_corrupt" for e in f.evidence)
    doc = f.to_dict()
    assert doc["cause"]["kind"] == "corrupted_parameters"
    assert any(p["module"] == "layers.1.down" and p["nan"] == 1 for p in doc["parameters"])


def test_inf_in_one_scale_group_is_named(tmp_path):
    class Scaled(nn.Module):
        """A group-wise dequantizing linear (weight codes x per-group scales), GPTQ-like."""

        def __init__(self, k: int = 8, n: int = 8, g: int = 4) -> None:
            super().__init__()
            self.g = g
            self.register_buffer("qweight", torch.randint(-7, 8, (n, k), dtype=torch.int8))
            self.scales = nn.Parameter(torch.full((n, k // g), 0.05), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = self.qweight.float() * self.scales.repeat_interleave(self.g, dim=1)
            return x @ w.t()

    m = Tiny()
    m.layers[2].down = nn.Sequential()  # keep shapes: replace with the quantized layer below
    m.layers[2].down = Scaled(k=16, n=8, g=4)
    with torch.no_grad():
        m.layers[2].down.scales[5, 2] = float("inf")
    _run(m, tmp_path / "s.h5", ids())
    f = analyze_trace(tmp_path / "s.h5")
    assert f.status == FAILED and f.first_nonfinite.producer == "layers.2.down"
    t = {x["param"]: x for x in f.cause.tensors}
    assert f.cause.kind == "corrupted_parameters"
    assert t["scales"]["inf"] == 1 and t["scales"]["row"] == 5
    assert "row 5, column 2" in t["scales"]["first_nonfinite"]


def test_tied_embedding_corruption_names_both(tmp_path):
    class TiedTiny(Tiny):
        def __init__(self) -> None:
            super().__init__(vocab=16, d=8)
            self.head = nn.Linear(8, 16, bias=False)
            self.head.weight = self.emb.weight

    m = TiedTiny()
    with torch.no_grad():
        m.emb.weight[2, 4] = float("nan")  # token id 2 is in ids()
    _run(m, tmp_path / "e.h5", ids())
    f = analyze_trace(tmp_path / "e.h5")
    assert f.status == FAILED and f.first_nonfinite.is_gap  # the embedding is not hooked
    assert f.cause.kind == "corrupted_parameters"
    # one storage, one entry: the embedding the gap reads, with the head it is tied to
    assert len(f.cause.tensors) == 1
    t = f.cause.tensors[0]
    assert t["row"] == 2 and t["tied_with"] == ["head.weight"]
    assert t["words"].startswith("emb.weight (tied to head.weight): 1 NaN")
    assert "emb.weight" in f.cause.line and "head.weight" in f.cause.line


def test_untied_embedding_corruption_is_named_though_not_hooked(tmp_path):
    """No hooked module holds the bad row: the root's info carries the embedding's health."""
    m = Tiny()
    with torch.no_grad():
        m.emb.weight[2, 4] = float("nan")  # token id 2 is in ids()
        m.emb.weight[3, 0] = float("inf")
    _run(m, tmp_path / "u.h5", ids())
    f = analyze_trace(tmp_path / "u.h5")
    assert f.status == FAILED and f.first_nonfinite.is_gap
    assert f.cause.kind == "corrupted_parameters"
    [t] = f.cause.tensors
    assert (t["param"], t["nan"], t["inf"], t["row"]) == ("weight", 1, 1, 2)
    assert "tied_with" not in t
    assert "unhooked op before" in f.cause.line and "emb.weight: 1 NaN and 1 Inf" in f.cause.line


def test_fp16_overflow_inside_the_producer(tmp_path):
    m = Tiny().half()
    with torch.no_grad():
        m.emb.weight.fill_(200.0)  # finite input ...
        m.layers[0].up.weight.fill_(60.0)  # ... and weights: 8 x 200 x 60 = 96,000 > 65,504
    x = ids()
    with torch.no_grad():
        emb = m.emb(x).float()
    assert emb.abs().max() < 65504
    _run(m, tmp_path / "o.h5", x)
    f = analyze_trace(tmp_path / "o.h5")
    assert f.status == FAILED and f.first_nonfinite.producer == "layers.0.up"
    assert f.cause.kind == "compute_overflow" and f.cause.limit == 65504


def test_unhooked_op_stays_the_cause(tmp_path):
    class Gap(Tiny):
        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            x = self.emb(input_ids)
            x = self.layers[0](x)
            x = torch.log(x - 1e9)  # an unhooked op makes NaN
            for layer in self.layers[1:]:
                x = layer(x)
            return self.head(x)

    _run(Gap(), tmp_path / "g.h5", ids())
    f = analyze_trace(tmp_path / "g.h5")
    assert f.status == FAILED and f.cause.kind == "unhooked_op"


def test_healthy_tiny_model_passes_with_no_parameter_evidence(tmp_path):
    _run(Tiny(), tmp_path / "h.h5", ids(), steps=3)
    f = analyze_trace(tmp_path / "h.h5")
    assert f.status == PASSED and f.cause is None
    assert [e.kind for e in f.evidence if e.source == "parameters"] == []


def test_mostly_zero_weights_read_suspect(tmp_path):
    m = Tiny()
    with torch.no_grad():
        w = m.layers[1].up.weight
        w[w.abs() < w.abs().quantile(0.8)] = 0.0  # 80% exact zeros, set here
    _run(m, tmp_path / "z.h5", ids(), steps=2)
    f = analyze_trace(tmp_path / "z.h5")
    assert f.status == SUSPECT
    ev = {e.kind: e for e in f.evidence}["parameters_mostly_zero"]
    assert ev.modules == ["layers.1.up"] and ev.details[0]["zero_share"] >= 0.79
    assert f.to_dict()["thresholds_rationale"]["param_zero_share"]
