"""`analyze --reference` and `report --reference`: where the error starts and how it grows,
against the committed FP16 reference trace of the same prompt."""

from __future__ import annotations

import json

import h5py

from qforensics.cli import main


def _zero_counts(path: str) -> dict[str, int]:
    with h5py.File(path, "r") as h:
        names = [n.decode() if isinstance(n, bytes) else n for n in h["modules/name"][:]]
        infos = [json.loads(x) for x in h["modules/info"][:]]
    return {n: i["health"]["weight"]["zero"] for n, i in zip(names, infos)
            if i.get("health", {}).get("weight")}


def test_analyze_reference_json(runner, sample):
    sus, ref = sample("int4-per-tensor-weights"), sample("fp16-reference")
    r = runner.invoke(main, ["analyze", sus, "--reference", ref, "--json"])
    assert r.exit_code == 1, r.output
    d = json.loads(r.output)["reference"]
    # independent: the modules whose weights differ from the reference's (zero counts)
    a, b = _zero_counts(sus), _zero_counts(ref)
    changed = {n for n in a if a[n] != b.get(n)}
    assert d["first_diverging"]["module"] in changed and d["starts_at"] == "quantized"
    assert [x["layer"] for x in d["per_layer"]] == [f"model.layers.{i}" for i in range(30)]
    assert all(x["score"] > 0 for x in d["per_layer"])


def test_reference_on_the_reference_itself_finds_no_divergence(runner, sample):
    ref = sample("fp16-reference")
    r = runner.invoke(main, ["analyze", ref, "--reference", ref, "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)["reference"]
    assert d["starts_at"] == "none" and d["first_diverging"] is None
    assert all(x["score"] == 0 for x in d["per_layer"])


def test_reference_text_and_bad_usage(runner, sample, tmp_path):
    sus, ref = sample("int4-per-tensor-weights"), sample("fp16-reference")
    r = runner.invoke(main, ["analyze", sus, "--reference", ref])
    assert "Against the reference" in r.output and "error per layer: 0:" in r.output
    r = runner.invoke(main, ["analyze", sus, ref, "--reference", ref])
    assert r.exit_code == 2 and "exactly one TRACE" in r.output
    bad = tmp_path / "bad.h5"
    bad.write_bytes(b"not hdf5")
    r = runner.invoke(main, ["analyze", sus, "--reference", str(bad)])
    assert r.exit_code == 2


def test_report_reference_sentence(runner, sample, tmp_path):
    sus, ref = sample("int4-per-tensor-weights"), sample("fp16-reference")
    out = tmp_path / "r.html"
    r = runner.invoke(main, ["report", sus, "--reference", ref, "-o", str(out)])
    assert r.exit_code in (0, 1), r.output
    assert "Against the reference trace: the error starts at a quantized layer" in \
        out.read_text()
