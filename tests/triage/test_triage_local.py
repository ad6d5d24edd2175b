"""`qforensics triage` on a real embedded LocalCluster: the groups, the ranks of one run as one
incident, what sets a group apart, unreadable files listed, the Parquet table and --json."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from expected import cause_words, expected_groups

from qforensics.cli import main


@pytest.fixture(scope="module")
def ran(fleet_dir, tmp_path_factory):
    d, specs, bad = fleet_dir
    out = tmp_path_factory.mktemp("triage-out")
    res = CliRunner().invoke(main, ["triage", str(d), "-o", str(out), "--json",
                                    "--workers", "2"])
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return res, json.loads(res.stdout), out, specs, bad


def test_groups_match_the_incidents_written(ran):
    res, doc, _, specs, bad = ran
    assert res.exit_code == 1  # FAILED groups
    assert doc["traces"] == len(specs) + len(bad)
    assert doc["healthy"] == sum(1 for s in specs if s.incident is None)
    want = expected_groups(specs)
    got = [{"verdict": g["verdict"], "producer": g["producer"], "cause": g["cause"],
            "count": g["count"], "traces": sorted(g["traces"])} for g in doc["groups"]]
    assert [g["verdict"] for g in got] == [g["verdict"] for g in want]
    for g, w in zip(got, want):
        assert g["count"] == w["count"] and g["traces"] == w["traces"], (g, w)
        assert g["cause"] == cause_words(w)
        if w["producer"] is not None:
            assert g["producer"] == w["producer"]


def test_the_ranks_of_one_run_are_one_incident_named_by_the_first_rank(ran):
    _, doc, _, specs, _ = ran
    tp = [s for s in specs if s.world == 2]
    g = next(g for g in doc["groups"] if tp[0].path in g["traces"])
    assert sorted(g["traces"]) == sorted(s.path for s in tp)
    assert g["count"] == 1 and g["first_rank"] == 0 and g["ranks"] == [0, 1]
    # vLLM's fused qkv_proj named in HF spelling; the site in vLLM's
    assert g["producer"] == f"model.layers.{tp[0].layer}.self_attn.q_proj+k_proj+v_proj"
    assert g["site"] == f"model.layers.{tp[0].layer}.self_attn.qkv_proj"
    assert g["representative"] == next(s.path for s in tp if s.rank == 0)


def test_what_sets_the_fp8_group_apart(ran):
    _, doc, _, specs, _ = ran
    fp8 = [s for s in specs if s.incident == "fp8_outlier"]
    healthy = [s for s in specs if s.incident is None]
    g = next(g for g in doc["groups"] if fp8[0].path in g["traces"])
    apart = {a["attribute"]: a for a in g["apart"]}
    # built so: only these replicas run vLLM 0.11.1 with prompts over 512 tokens
    assert apart["engine"]["value"] == f"vllm {fp8[0].version}"
    assert (apart["engine"]["affected"], apart["engine"]["healthy"]) == (len(fp8), 0)
    assert 256 < fp8[0].prompt <= 1024 and all(s.prompt <= 64 for s in healthy)
    assert apart["prompt length"]["value"] == "257-1024"
    assert apart["prompt length"]["healthy"] == 0
    assert apart["prompt length"]["of_healthy"] == len(healthy)
    assert "host" not in apart  # two different replicas


def test_unreadable_files_are_listed_with_their_reason(ran):
    _, doc, _, _, bad = ran
    got = {u["path"]: u for u in doc["unreadable"]}
    assert sorted(got) == sorted(bad.values())
    assert all(not u["internal"] and u["reason"] for u in got.values())
    assert "ExternalLink" in got[bad["extlink"]]["reason"]
    assert "cut short" in got[bad["truncated"]]["reason"]
    assert "not an HDF5 file" in got[bad["garbage"]]["reason"]


def test_parquet_has_one_row_per_trace_and_per_group(ran):
    _, doc, out, specs, bad = ran
    t = pq.read_table(out / "triage.parquet").to_pandas()
    traces, groups = t[t["kind"] == "trace"], t[t["kind"] == "group"]
    assert len(traces) == len(specs) + len(bad) and len(groups) == len(doc["groups"])
    assert sorted(traces["path"]) == sorted([s.path for s in specs] + list(bad.values()))
    for g in doc["groups"]:
        row = groups[groups["group"] == g["id"]].iloc[0]
        assert row["count"] == g["count"] and row["representative"] == g["representative"]
        members = traces[traces["group"] == g["id"]]
        assert sorted(members["path"]) == sorted(g["traces"])
    assert sorted(groups["rank_count"]) == list(range(1, len(doc["groups"]) + 1))
    assert set(traces[traces["status"] == "UNREADABLE"]["path"]) == set(bad.values())


def test_representative_reports_are_written(ran):
    _, doc, out, _, _ = ran
    reports = sorted((out / "reports").glob("group-*.html"))
    assert len(reports) == len(doc["groups"])
    for g in doc["groups"]:
        text = (out / "reports" / f"group-{g['id']:03d}.html").read_text()
        assert g["verdict"] in text


def test_a_path_that_matches_nothing_is_bad_usage(tmp_path):
    res = CliRunner().invoke(main, ["triage", str(tmp_path / "nothing-*.h5"), "--json"])
    assert res.exit_code == 2 and "no trace matches" in res.stderr
    res = CliRunner().invoke(main, ["triage", str(tmp_path)])
    assert res.exit_code == 2 and "no trace" in res.stderr
