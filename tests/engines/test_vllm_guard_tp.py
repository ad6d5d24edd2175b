"""The vLLM guard under tensor parallelism, on the real engine and the real SmolLM2 (bf16).

One weight of `model.layers.3.mlp.gate_proj` (HF name; vLLM fuses gate and up into the
column-parallel `gate_up_proj`) is NaN. With 3 ranks, vLLM gives each rank an equal slice of the
gate rows and of the up rows, so the NaN row lands on rank ROW // (1536 / 3), and only that
rank's slice of gate_up's output is NaN: the row-parallel down_proj's all-reduce then spreads it
to every rank. Unguarded, every logit is NaN. Guarded, each rank reruns the step (the hidden
states are the same on every rank, so they agree), the rank that holds the NaN row finds its
gate_up output non-finite on finite input and falls back on its own shard; the other ranks have
nothing to repair. Expectations: vLLM's partition rule, the healthy TP run's tokens.
"""

from __future__ import annotations

import shutil

import pytest

from qforensics.trace.reader import open_trace
from tests.engines.conftest import PROMPT_A, PROMPT_B, run_recorded
from tests.engines.test_vllm_tensor_parallel import TP, _binding

pytestmark = pytest.mark.vllm

LAYER, ROW, COL = 3, 612, 7
HF_WEIGHT = f"model.layers.{LAYER}.mlp.gate_proj.weight"
FUSED = f"model.layers.{LAYER}.mlp.gate_up_proj"
TOKENS = 8
SERVE = ["--tensor-parallel-size", str(TP), "--memory-utilization", "0.15"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, bf16_model_dir):
    import torch
    from safetensors.torch import load_file, save_file

    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_CPU_OMP_THREADS_BIND", _binding(TP))
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # a fixed schedule (test_vllm_identical)
    try:
        bad = tmp_path_factory.mktemp("nan-gate-model")
        for f in bf16_model_dir.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, bad / f.name)
        sd = load_file(str(bf16_model_dir / "model.safetensors"))
        w = sd[HF_WEIGHT].clone()
        inter = w.shape[0]
        w[ROW, COL] = float("nan")
        sd[HF_WEIGHT] = w
        save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
        out = {"inter": inter}
        for name, folder, extra in (("healthy", bf16_model_dir, None), ("nan", bad, None),
                                    ("guarded", bad, ["--guard"])):
            out[name] = run_recorded(tmp_path_factory.mktemp(f"tp-{name}"), folder,
                                     [PROMPT_A, PROMPT_B], TOKENS, extra=extra, serve_args=SERVE)
    finally:
        mp.undo()
    return out


def _tokens(run) -> list[list[int]]:
    return [o["token_ids"] for o in run["outputs"]["runs"][-1]["outputs"]]


def _incidents(path):
    with open_trace(path) as t:
        return t.incidents


def test_unguarded_the_nan_weight_breaks_every_request(runs):
    healthy, nan = _tokens(runs["healthy"]), _tokens(runs["nan"])
    assert all(len(t) == TOKENS for t in healthy)
    for h, n in zip(healthy, nan):
        assert n != h


def test_the_rank_holding_the_row_falls_back_on_its_shard(runs):
    owner = ROW // (runs["inter"] // TP)  # vLLM splits the gate rows evenly over the ranks
    files = runs["guarded"]["files"]
    assert [f.name for f in files] == [f"t-{r}.h5" for r in range(TP)]
    for rank, path in enumerate(files):
        inc = _incidents(path)
        mine = inc[inc["module"] == FUSED]
        if rank == owner:
            assert len(mine) >= 1, inc
            assert (mine["nan_count"] > 0).any()
        else:
            assert len(mine) == 0, mine
        # the row-parallel layers after it are never tripped: their NaN came in from the shard
        assert not inc["module"].str.contains("down_proj|o_proj").any(), inc


def test_guarded_requests_are_repaired_not_sanitized(runs):
    inc = _incidents(runs["guarded"]["files"][0])  # rank 0 holds the logits
    actions = set(inc["action"])
    assert "request_sanitized" not in actions, inc
    assert "request_repaired" in actions, inc
    healthy, guarded = _tokens(runs["healthy"]), _tokens(runs["guarded"])
    # the fallback zeroes the NaN weight and computes its shard densely in bf16: close to, not
    # bit-equal with, the healthy kernel; the first token of each request comes from the
    # prefill, where the NaN first appears, and the run then goes on from repaired states
    agree = sum(a == b for h, g in zip(healthy, guarded) for a, b in zip(h, g))
    assert agree >= 0.75 * TOKENS * len(healthy), (healthy, guarded)
