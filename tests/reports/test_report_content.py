"""The HTML report without a browser: content, escaping, self-containment, CSP, replay JSON
validation, large-trace binning, the CLI."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner
from report_inputs import HOSTILE_NAMES, HOSTILE_TEXT
from synth import OUTLIERS, write_synthetic_trace

from qforensics.analyze.findings import (
    DiffFindings,
    Divergence,
    Findings,
    FirstNonfinite,
    Gap,
    Spread,
    TraceEndInfo,
    Verdict,
)
from qforensics.errors import QForensicsError, TraceFormatError, UsageError
from qforensics.reports import (
    load_replay_result,
    parse_replay_result,
    render_report,
    write_report,
)
from qforensics.analyze.grid import bin_heatmap
from qforensics.reports.plots import plot_heatmap
from qforensics.reports.report import CSP_SCRIPT


def _replay_doc(**over):
    doc = {
        "schema": "qforensics.replay", "version": "3.0",
        "created_by": "qforensics 0.1.0", "bundle": "call94.h5", "call_index": 94,
        "module": "model.layers.11.mlp.down_proj",
        "shapes": {"M": 3, "N": 576, "K": 1536, "group_size": 128},
        "tile": {"row_start": 0, "row_stop": 3, "col_start": 0, "col_stop": 576, "first_nonfinite": [1, 341]},
        "results": [
            {"verdict": "INCONCLUSIVE", "path": "sanitizer", "summary": "sanitizer leg not run: no GPU",
             "reason": "no GPU", "errors": 0, "first": None, "details": {}},
            {"verdict": "KERNEL FAULT", "path": "sanitizer", "summary": "16-byte read 1 byte past x",
             "reason": None, "errors": 320,
             "first": {"kind": "read", "size": 16, "buffer": "x", "relation": "after",
                       "distance": 1, "frames": [{"deep": {"nested": 1}}]},
             "details": {"total_errors": 320}},
        ],
    }
    doc.update(over)
    return doc


# -- content ---------------------------------------------------------------------------------------
def test_failing_report_tells_the_story(reports, failing_trace):
    html = reports[failing_trace.stem].read_text()
    for sid in ("verdict", "chain", "output", "plots", "plot-logits", "plot-heatmap",
                "plot-channels", "recommendations", "table-outliers", "table-damage",
                "table-environment", "table-health"):
        assert f'id="{sid}"' in html, sid
    assert "FAILED" in html
    assert "down_proj" in html and "turned finite input into" in html
    assert "448" in html  # the FP8 e4m3 limit, with numbers
    for absmax in OUTLIERS.values():  # the two outlier channels' absmax, as planted
        assert f"{absmax:,.0f}" in html, absmax
    assert "qforensics whatif" in html and "--keep-salient" in html
    assert "FP8 cast behaviour" in html and "saturate" in html


def test_report_is_self_contained(reports):
    for name, path in reports.items():
        html = path.read_text()
        assert path.stat().st_size < 3 << 20, name
        assert not re.search(r"<(link|iframe|object|embed|base)\b", html, re.IGNORECASE), name
        assert not re.search(r"\b(src|href)\s*=\s*[\"']?(https?:|//)", html, re.IGNORECASE), name
        assert not re.search(r"url\(", html), name  # no CSS fetches
        srcs = re.findall(r"<img[^>]*\bsrc=\"([^\"]*)\"", html)
        assert srcs and all(s.startswith("data:image/png;base64,") for s in srcs), name
        assert re.findall(r"<script\b[^>]*>", html) == ["<script>"], name


def test_csp_allows_exactly_our_script(reports, failing_trace):
    html = reports[failing_trace.stem].read_text()
    m = re.search(r'<meta http-equiv="Content-Security-Policy" content="([^"]+)">', html)
    assert m, "CSP meta tag missing"
    csp = m.group(1).replace("&#39;", "'")
    assert "default-src 'none'" in csp and "img-src data:" in csp
    digest = base64.b64encode(hashlib.sha256(CSP_SCRIPT.encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in csp
    scripts = re.findall(r"<script>(.*?)</script>", html, re.DOTALL)
    assert scripts == [CSP_SCRIPT]


def test_hostile_strings_are_escaped(reports):
    html = reports["hostile"].read_text()
    for raw in list(HOSTILE_NAMES.values()) + [HOSTILE_TEXT]:
        if "<" in raw:
            assert raw not in html, f"unescaped: {raw!r}"
    assert "&lt;script&gt;window.__pwned=4&lt;/script&gt;" in html
    assert "&lt;img src=x onerror=" in html
    assert "&lt;b&gt;evil-host&lt;/b&gt;" in html
    assert "<b>evil-host</b>" not in html
    assert "</style><script>" not in html


def test_passed_trace_and_generated_text(tmp_path):
    path = write_synthetic_trace(tmp_path / "ok.h5", fail=False, text="Paris.\n<end>")
    html, f = render_report(path)
    # finite everywhere, but the synthetic outcome records 25% top-1 agreement: SUSPECT by it alone
    assert f.verdict.status == "SUSPECT" and [p.kind for p in f.precursors] == ["outcome"]
    assert "Paris.\n&lt;end&gt;" in html
    assert ('id="plot-channels"' in html) == bool(f.outliers)


def test_gap_producer_from_constructed_findings(tmp_path):
    """Templates work from Findings built by hand (e.g. an unhooked op produced the NaN)."""
    path = write_synthetic_trace(tmp_path / "t.h5")
    gap = Gap(last_finite_call=4, last_finite_module="model.layers.1.mlp.up_proj",
              first_bad_call=6, first_bad_module="model.layers.1.mlp.down_proj",
              description="an unhooked op (e.g. torch.nn.functional.silu) between call 4 "
                          "and call 6 produced the first NaN")
    fn = FirstNonfinite(step=0, call_index=6, module="model.layers.1.mlp.down_proj",
                        module_kind="quantized_linear", io=0, tensor="input", slot=0, kind="nan",
                        nan_count=640, inf_count=0, numel=640, producer=gap, input_min=None,
                        input_max=None, input_absmax=None,
                        spread=Spread(11, 17, 6, 6, 20, 6))
    f = Findings(trace=str(path), rank=0, world_size=1, n_steps=6, n_modules=17,
                 end=TraceEndInfo(True, 5, "complete: 6 steps"), environment={},
                 verdict=Verdict("FAILED", "FAILED | first non-finite at step 0, call 6: "
                                           "NaN arrived in the input"),
                 first_nonfinite=fn)
    html, _ = render_report(path, findings=f)
    assert "an op the capture does not hook" in html
    assert "only passed it on" in html
    assert "torch.nn.functional.silu" in html


def test_divergence_from_constructed_diff(tmp_path):
    path = write_synthetic_trace(tmp_path / "t.h5")
    divs = [Divergence(module=f"model.layers.{i}.mlp.down_proj", step=0, io=1, slot=0,
                       call_index=i, suspect_call_index=i, rel_absmax=0.1 * i, rel_std=0.1,
                       rel_mean=0.0, channel_div=0.05 * i, sqnr_db=None, cosine=None,
                       score=0.05 * (i + 1), jump=0.05, nonfinite=i >= 2) for i in range(4)]
    diff = DiffFindings(reference="ref.h5", suspect=str(path),
                        verdict=Verdict("FAILED", "FAILED | divergence jumps at call 2"),
                        n_aligned=34, n_only_reference=0, n_only_suspect=0, steps_compared=[0],
                        first_jump=divs[2], ranked=divs)
    html, _ = render_report(path, diff=diff)
    assert 'id="plot-divergence"' in html and 'id="table-divergence"' in html
    assert "first jump in divergence" in html


def test_reference_trace_is_diffed(traces, tmp_path):
    if "fp16-reference" not in traces:
        ref = write_synthetic_trace(tmp_path / "ref.h5", fail=False, seed=3)
        sus = traces["synthetic-fail"]
    else:
        ref, sus = traces["fp16-reference"], traces["int4-per-tensor-act"]
    html, _ = render_report(sus, reference=ref)
    assert 'id="plot-divergence"' in html and 'id="table-divergence"' in html


# -- replay result ---------------------------------------------------------------------------------
def test_replay_result_is_shown(tmp_path, failing_trace):
    doc = _replay_doc()
    doc["results"][1]["summary"] = "<script>window.__pwned=9</script> read past x"
    p = tmp_path / "replay.json"
    p.write_text(json.dumps(doc))
    html, _ = render_report(failing_trace, replay=p)
    assert 'id="replay"' in html and "KERNEL FAULT" in html and "INCONCLUSIVE" in html
    assert "&lt;script&gt;window.__pwned=9" in html and "<script>window.__pwned" not in html
    assert "deep" not in html  # nested structures are not dumped into the page


@pytest.mark.parametrize("doc, words", [
    ({"schema": "something-else", "version": "1.0", "results": []}, "not a replay result"),
    (_replay_doc(version="4.0"), "newer than this qforensics reads (3.x); upgrade"),
    (_replay_doc(version=3), "'version' must be a string"),
    ({"schema": "qforensics-replay-result", "schema_version": "2.0", "results": []},
     "expected 'qforensics.replay'"),
    (_replay_doc(results={"a": 1}), "'results' must be a list"),
    (_replay_doc(results=[{"verdict": "PWNED", "path": "gpu", "summary": "x"}]), "verdict"),
    (_replay_doc(results=[{"verdict": "DATA", "path": 3, "summary": "x"}]), "strings"),
    (_replay_doc(results=[{"verdict": "DATA", "path": "e", "summary": "x", "errors": -1}]),
     "errors"),
    (_replay_doc(call_index="94"), "call_index"),
    ([1, 2], "JSON object"),
])
def test_bad_replay_results_are_refused(doc, words):
    with pytest.raises(UsageError, match=re.escape(words)):
        parse_replay_result(doc, "r.json")


def test_replay_file_not_json(tmp_path):
    p = tmp_path / "r.json"
    p.write_bytes(b"\xff\xfe not json")
    with pytest.raises(UsageError, match="not valid JSON"):
        load_replay_result(p)
    with pytest.raises(UsageError, match="no such file"):
        load_replay_result(tmp_path / "missing.json")


# -- large traces ----------------------------------------------------------------------------------
def test_heatmap_bins_large_grids():
    rng = np.random.default_rng(0)
    vals = rng.normal(size=(1000, 700))
    bad = np.zeros(vals.shape, bool)
    bad[333, 555] = True
    vals[10, 10] = 99.0
    vals[20:40, :] = np.nan
    hm = bin_heatmap(vals, bad, [f"m{i}" for i in range(1000)], mark=(333, 555))
    assert hm.values.shape[0] <= 200 and hm.values.shape[1] <= 200 and hm.binned
    assert np.nanmax(hm.values) == 99.0 and hm.bad.sum() == 1
    assert hm.bad[hm.mark]  # the marked cell is the bin holding the bad record
    fig = plot_heatmap(hm)
    assert fig is not None and len(fig.data_uri) < 1_000_000


def test_large_trace_report_stays_small(tmp_path):
    path = write_synthetic_trace(tmp_path / "big.h5", n_layers=55, n_steps=24)  # 221 modules
    out = write_report(path, tmp_path / "big.html")
    html = out.path.read_text()
    assert out.bytes < 3 << 20
    assert "Binned to" in html


# -- CLI -------------------------------------------------------------------------------------------
def _cli(args):
    from qforensics.cli import main

    return CliRunner().invoke(main, args)


def test_cli_writes_and_prints(tmp_path, failing_trace):
    out = tmp_path / "incident.html"
    r = _cli(["report", str(failing_trace), "-o", str(out)])
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert lines[0].startswith(f"wrote {out}") and lines[1].startswith("FAILED | ")
    assert out.exists()


def test_cli_help_ends_with_example():
    r = _cli(["report", "--help"])
    assert r.exit_code == 0
    lines = r.output.rstrip().splitlines()
    example = max(i for i, line in enumerate(lines) if line.strip() == "Example:")
    assert example > max(i for i, line in enumerate(lines) if line.strip() == "Options:")
    assert all(line.strip().startswith("qforensics report") for line in lines[example + 1:])


@pytest.mark.parametrize("content", [None, b"not an hdf5 file"])
def test_cli_unreadable_trace_exits_2(tmp_path, content):
    p = tmp_path / "bad.h5"
    if content is not None:
        p.write_bytes(content)
    r = _cli(["report", str(p), "-o", str(tmp_path / "x.html")])
    assert r.exit_code == 2, r.output
    assert "Error:" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "x.html").exists()


def test_cli_bad_replay_exits_2(tmp_path, failing_trace):
    p = tmp_path / "r.json"
    p.write_text(json.dumps({"schema": "nope"}))
    r = _cli(["report", str(failing_trace), "-o", str(tmp_path / "x.html"), "--replay", str(p)])
    assert r.exit_code == 2 and "not a replay result" in r.output


def test_errors_are_user_errors(tmp_path):
    with pytest.raises(TraceFormatError):
        write_report(tmp_path / "missing.h5", tmp_path / "x.html")
    assert issubclass(UsageError, QForensicsError)


def test_report_path_does_not_import_torch(failing_trace, tmp_path):
    code = ("import sys; from qforensics.reports import write_report; "
            f"write_report({str(failing_trace)!r}, {str(tmp_path / 'r.html')!r}); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
