"""Guard incidents travel from capture into the trace, the analysis and the report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from click.testing import CliRunner

import qforensics
from qforensics.analyze import analyze_trace
from qforensics.cli import main
from qforensics.reports import write_report

sys.path.insert(0, str(Path(__file__).parent / "hooks"))
from capture_models import Tiny, ids  # noqa: E402

EVIL = "<script>window.__pwned=1</script>"


def _trace(tmp_path):
    m = Tiny()
    with torch.no_grad():
        m.layers[1].up.weight[0, 0] = float("nan")
    path = tmp_path / "t.h5"
    with qforensics.capture(m, path) as cap:
        m(ids())
        cap.record_incident("layers.1.up", "fallback", nan_count=4, detail="fallback used")
        m(ids())
        cap.record_incident(EVIL, "sanitize_logits", nan_count=16, detail=EVIL)
    return path


def test_incidents_in_trace_analysis_and_json(tmp_path):
    path = _trace(tmp_path)
    with qforensics.open_trace(path) as t:
        inc = t.incidents
        assert inc.action.tolist() == ["fallback", "sanitize_logits"]
        assert inc.step.tolist() == [0, 1]  # the step that was running (or just ended)
        assert inc.module_id.tolist()[0] == t.modules.name.tolist().index("layers.1.up")
    f = analyze_trace(str(path))
    assert [i.action for i in f.incidents] == ["fallback", "sanitize_logits"]
    assert "(runtime guard: 2 incidents, fallback, sanitize_logits)" in f.verdict.line
    res = CliRunner().invoke(main, ["analyze", str(path)])
    assert res.exit_code == 1
    assert "Runtime guard incidents (2: fallback 1, sanitize_logits 1)" in res.output
    res = CliRunner().invoke(main, ["analyze", str(path), "--json"])
    doc = json.loads(res.output)
    assert doc["incidents"][0]["module"] == "layers.1.up"


def test_incidents_in_report_are_escaped(tmp_path):
    path = _trace(tmp_path)
    out = tmp_path / "r.html"
    write_report(str(path), str(out))
    html = out.read_text()
    assert 'id="table-incidents"' in html
    assert EVIL not in html
    assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in html
