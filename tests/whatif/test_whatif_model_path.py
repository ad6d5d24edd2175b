"""The model path a trace records (HF folder, GGUF file, vLLM's `model=`), and what-if using it
by default: validated as untrusted input, never importing code a trace names, exit 2 when it
is missing or gone."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from torch import nn

import qforensics
from qforensics.cli import main
from qforensics.errors import UsageError
from qforensics.whatif.model import describe_mismatch, resolve_model_source


def _tiny_trace(path, metadata=None):
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with qforensics.capture(m, path, metadata=metadata or {}):
        m(torch.ones(1, 4))
    return path


def _whatif(trace, *extra):
    return CliRunner().invoke(main, ["whatif", str(trace), "--scheme", "int4-g128", *extra])


def test_model_path_of_a_gguf_load_is_the_gguf_file(tmp_path):
    """transformers keeps `gguf_file=` in config.quantization_config beside _name_or_path."""
    from transformers.utils.quantization_config import GgufConfig

    from qforensics.hooks.environment import _model_path

    f = tmp_path / "m.Q4_0.gguf"
    f.write_bytes(b"GGUF")
    for qc in (GgufConfig(gguf_file=f.name), {"quant_method": "gguf", "gguf_file": f.name}):
        m = nn.Linear(2, 2)
        m.config = SimpleNamespace(_name_or_path=str(tmp_path), quantization_config=qc)
        assert _model_path(m) == str(f.resolve())
    m.config = SimpleNamespace(_name_or_path=str(tmp_path),
                               quantization_config=GgufConfig(gguf_file=str(f)))
    assert _model_path(m) == str(f.resolve())  # an absolute gguf_file
    m.config = SimpleNamespace(_name_or_path=str(tmp_path))  # no config.json, no GGUF
    assert _model_path(m) is None


@pytest.mark.model
def test_a_real_gguf_load_is_recorded_and_rerun_by_default(tmp_path, demo):
    from transformers import AutoModelForCausalLM

    from qforensics.demo.model import gguf_path

    g = gguf_path()
    model = AutoModelForCausalLM.from_pretrained(g.parent, gguf_file=g.name,
                                                 dtype=torch.float32).eval()
    _, tok = demo
    ids = tok("What is the capital of France?", return_tensors="pt")["input_ids"]
    trace = tmp_path / "gguf.h5"
    with torch.no_grad(), qforensics.capture(model, trace):
        model(ids)
    with qforensics.open_trace(trace) as t:
        assert t.meta["environment"]["model_path"] == str(g.resolve())
    r = _whatif(trace, "--max-new-tokens", "4", "--text-tokens", "16")
    assert r.exit_code == 0, r.output
    assert f"loading GGUF file {g.resolve()} (the trace's metadata)" in r.output


def test_a_factory_named_by_a_trace_is_never_imported(tmp_path, monkeypatch):
    marker = tmp_path / "imported"
    (tmp_path / "evil_factory_mod.py").write_text(
        f"open({str(marker)!r}, 'w').close()\ndef build():\n    raise SystemExit(9)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    trace = _tiny_trace(tmp_path / "t.h5", {"model_path": "evil_factory_mod:build"})
    r = _whatif(trace)
    assert r.exit_code == 2, r.output
    assert "names a model factory" in r.output and "never imports" in r.output
    assert not marker.exists() and "evil_factory_mod" not in sys.modules


@pytest.mark.parametrize("recorded, message", [
    ("relative/model", "which is not here"),
    ("bad\x00path", "malformed"),
    ("x" * 5000, "malformed"),
])
def test_bad_recorded_paths_are_refused(tmp_path, recorded, message):
    with pytest.raises(UsageError, match=message):
        resolve_model_source(None, {"environment": {"model_path": recorded}})


def test_recorded_paths_must_be_absolute_folders_or_gguf_files(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("x")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match="is relative"):
        resolve_model_source(None, {"environment": {"model_path": "m"}})
    with pytest.raises(UsageError, match="neither an HF folder"):
        resolve_model_source(None, {"environment": {"model_path": str(tmp_path / "notes.txt")}})
    src = resolve_model_source(None, {"environment": {"model_path": str(tmp_path / "m")}})
    assert (src.kind, src.value, src.origin) == ("hf", str(tmp_path / "m"),
                                                 "the trace's metadata")


def test_missing_or_gone_model_paths_exit_2(tmp_path):
    gone = tmp_path / "gone-model"
    trace = _tiny_trace(tmp_path / "gone.h5", {"model_path": str(gone)})
    r = _whatif(trace)
    assert r.exit_code == 2 and f"recorded from {gone}, which is not here" in r.output
    r = _whatif(_tiny_trace(tmp_path / "none.h5"))
    assert r.exit_code == 2 and "records no model path" in r.output
    assert "Traceback" not in r.output


def test_demo_traces_written_before_model_paths_use_the_demo():
    src = resolve_model_source(None, {"environment": {"scenario": "fp16-reference"}})
    assert src.kind == "demo" and "fp16-reference" in src.origin
    with pytest.raises(UsageError, match="records no model path"):
        resolve_model_source(None, {"environment": {"scenario": "not-a-demo-scenario"}})


class _FakeTrace:
    """What describe_mismatch reads of a vLLM trace: metadata and the hooked modules."""

    def __init__(self, names, params):
        self.meta = {"environment": {
            "model_class": "Toy", "engine": {"name": "vllm", "hf_names": {
                "layer.qkv_proj": ["layer.q_proj", "layer.k_proj", "layer.v_proj"]}}}}
        self.modules = pd.DataFrame({"name": names})
        self._params = params

    def module_info(self, mid):
        return {"params": self._params.get(mid, {})}


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Module()
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self.layer, n, nn.Linear(8, 8))


def test_a_vllm_traces_fused_layers_match_the_hf_layers_they_hold():
    trace = _FakeTrace(["layer.qkv_proj", "layer.o_proj", ""],
                       {0: {"weight": {"shape": [24, 8]}}, 1: {"weight": {"shape": [8, 8]}}})
    assert describe_mismatch(trace, Toy()) == []
    other = Toy()
    del other.layer.v_proj
    diffs = describe_mismatch(trace, other)
    assert len(diffs) == 1 and "layer.v_proj" in diffs[0]
