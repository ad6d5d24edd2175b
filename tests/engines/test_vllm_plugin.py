"""Capture through vLLM's plugin system, without `qforensics record`: the installed package
registers a `vllm.general_plugins` entry point that vLLM calls in each of its processes; with
QFORENSICS_TRACE set, the worker writes the trace (no bootstrap on PYTHONPATH)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from qforensics.trace.reader import open_trace
from vllm_runs import PROMPT_B

pytestmark = pytest.mark.vllm


def test_the_plugin_attaches_capture_in_the_worker(tmp_path, bf16_model_dir):
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("qforensics") == "qforensics.engines.vllm:register_plugin"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({"QFORENSICS_TRACE": str(tmp_path / "p-{rank}.h5"), "VLLM_CPU_KVCACHE_SPACE": "1"})
    out = tmp_path / "o.json"
    proc = subprocess.run([sys.executable, "-m", "qforensics.demo.vllm_serve",
                           str(bf16_model_dir), "--prompt", PROMPT_B, "--max-tokens", "3",
                           "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "vLLM worker rank 0: capturing" in proc.stderr
    toks = json.loads(out.read_text())["runs"][0]["outputs"][0]["token_ids"]
    with open_trace(tmp_path / "p-0.h5") as t:
        sampled = t.engine_table("sampled").sort_values("step")["token"].tolist()
        assert t.meta["status"]["state"] == "complete"
    assert sampled == toks
