"""`qforensics report --whatif whatif.json`: the Recommendations section shows the what-if
table (figures judged on, memory against bf16) and the recommendation whatif wrote; the file is
validated like any untrusted input."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from synth import write_synthetic_trace

from qforensics.cli import main
from qforensics.errors import UsageError
from qforensics.jsondoc import document, dumps
from qforensics.reports import load_whatif_result, parse_whatif_result, render_report
from qforensics.whatif.recommend import parse_target, recommend
from qforensics.whatif.results import SchemeResult, WhatIfResult

HOSTILE = "<script>window.__pwned=5</script>"


def _doc(target: str = "99%") -> dict:
    res = WhatIfResult(trace="t.h5", prompt_source="p", salient_source="s", ref_text="t",
                       ref_ppl=10.0, positions=8, text_tokens=100)
    for label, rec, mem in (("ct:W8A8", 0.995, 0.56), ("ct:W4A16-g64", 0.72, 0.37),
                            (HOSTILE, 0.999, None)):
        s = SchemeResult(label, None, None, 1.0, 0.01, 10.0 / rec, 0.9, rec, False, "", 1.0)
        s.memory = None if mem is None else {"vs_bf16": mem}
        if label == "ct:W8A8":  # through vLLM: speed against bf16, and the trace's risk
            s.decode_speed_vs_bf16, s.prefill_speed_vs_bf16 = 1.5, 0.75
            s.risk = {"level": "low", "line": "salient input channels"}
        res.schemes.append(s)
    res.recommendation = recommend(res, parse_target(target))
    return document("qforensics.whatif", res.to_json())  # as `qforensics whatif --json`


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return write_synthetic_trace(tmp_path_factory.mktemp("whatif-report") / "t.h5")


def test_recommendations_show_the_whatif_table(trace, tmp_path) -> None:
    path = tmp_path / "w.json"
    path.write_text(dumps(_doc()))
    html, _ = render_report(trace, whatif=path)
    assert 'id="table-whatif"' in html and 'id="rec-whatif"' in html
    # 99%: ct:W8A8 (99.5%, 56% of bf16) and the hostile-named one (99.9%, no memory figure)
    # meet it; the least memory wins
    assert "recommendation (target recovered perplexity (ppl_ref / ppl) &gt;= 99%): ct:W8A8" \
        in html
    row = html.split("<code>ct:W8A8</code>", 1)[1].split("</tr>", 1)[0]
    assert "(recommended)" in row and "99.5%" in row and "56.0%" in row
    assert "1.50x" in row and "0.75x" in row and "<td>low</td>" in row
    assert HOSTILE not in html and "&lt;script&gt;window.__pwned=5" in html
    none = tmp_path / "none.json"
    none.write_text(dumps(_doc("99.95%")))
    html2, _ = render_report(trace, whatif=load_whatif_result(none))
    assert "no scheme meets it; closest: " in html2 and "(recommended)" not in html2


def test_a_bad_whatif_result_is_a_usage_error(tmp_path) -> None:
    for bad, why in (({"schema": "qforensics.replay", "version": "3.0"}, "not a what-if"),
                     ({**_doc(), "version": "2.0"}, "newer than this qforensics reads"),
                     ({**_doc(), "schemes": "x"}, "'schemes' must be a list"),
                     ({**_doc(), "schemes": [{"no": 1}]}, "'scheme' string")):
        with pytest.raises(UsageError, match=why):
            parse_whatif_result(bad, "w.json")
    p = tmp_path / "broken.json"
    p.write_text("{")
    with pytest.raises(UsageError, match="not valid JSON"):
        load_whatif_result(p)


def test_cli_report_whatif(trace, tmp_path) -> None:
    good = tmp_path / "w.json"
    good.write_text(dumps(_doc()))
    out = tmp_path / "r.html"
    r = CliRunner().invoke(main, ["report", str(trace), "-o", str(out), "--whatif", str(good)])
    assert r.exit_code == 0, r.output
    assert 'id="table-whatif"' in out.read_text()
    r = CliRunner().invoke(main, ["report", str(trace), "-o", str(out), "--whatif",
                                  str(tmp_path / "missing.json")])
    assert r.exit_code == 2 and "Traceback" not in r.output
