"""The vLLM guard under tensor parallelism, on the real engine and the real SmolLM2 (bf16).

Two weights are NaN, one in each kind of sharded layer:
- `model.layers.3.mlp.gate_proj` (HF name; vLLM fuses gate and up into the column-parallel
  `gate_up_proj`). vLLM gives each of the 3 ranks an equal slice of the gate rows, so the NaN row
  lands on rank GATE_ROW // (1536 / 3), and only that rank's slice of the output is NaN.
- `model.layers.7.mlp.down_proj`, row-parallel: each rank holds an equal slice of its input
  columns, so the NaN column lands on rank DOWN_COL // (1536 / 3); that rank's partial output is
  NaN, and vLLM's all-reduce inside the layer spreads it to every rank.
Unguarded, every logit is NaN. Guarded, each rank reruns the step (the hidden states are the
same on every rank, so they agree); the rank holding the gate row finds its gate_up output
non-finite on finite input and falls back on its shard; the rank holding the down column finds
its partial non-finite before the all-reduce and computes it from its dense shard; the third
rank repairs nothing. Expectations: vLLM's partition rule, the healthy TP run's tokens.
"""

from __future__ import annotations

import shutil

import pytest

from qforensics.trace.reader import open_trace
from vllm_runs import TP, TP_TOKENS as TOKENS, run_tp

pytestmark = pytest.mark.vllm

GATE = "model.layers.3.mlp.gate_proj.weight"  # column-parallel (fused into gate_up_proj)
GATE_ROW, GATE_COL = 612, 7
DOWN = "model.layers.7.mlp.down_proj.weight"  # row-parallel
DOWN_ROW, DOWN_COL = 100, 1100


@pytest.fixture(scope="module")
def runs(tmp_path_factory, bf16_model_dir, tp_healthy):
    from safetensors.torch import load_file, save_file

    bad = tmp_path_factory.mktemp("nan-gate-model")
    for f in bf16_model_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, bad / f.name)
    sd = load_file(str(bf16_model_dir / "model.safetensors"))
    inter = sd[GATE].shape[0]
    assert sd[DOWN].shape[1] == inter
    for key, row, col in ((GATE, GATE_ROW, GATE_COL), (DOWN, DOWN_ROW, DOWN_COL)):
        w = sd[key].clone()
        w[row, col] = float("nan")
        sd[key] = w
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    # the healthy run is the session's one TP start of the bf16 model (conftest.py), shared
    # with test_vllm_tensor_parallel; the NaN-weight runs start the same engine
    out = {"inter": inter, "healthy": tp_healthy}
    for name, extra in (("nan", None), ("guarded", ["--guard"])):
        out[name] = run_tp(tmp_path_factory.mktemp(f"tp-{name}"), bad, extra)
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


def test_each_rank_repairs_only_its_own_shard(runs):
    per_rank = runs["inter"] // TP  # vLLM splits the gate rows and down's columns evenly
    owners = {GATE_ROW // per_rank: "model.layers.3.mlp.gate_up_proj",
              DOWN_COL // per_rank: "model.layers.7.mlp.down_proj"}
    assert len(owners) == 2  # two different ranks, and one with nothing to repair
    files = runs["guarded"]["files"]
    assert [f.name for f in files] == [f"t-{r}.h5" for r in range(TP)]
    for rank, path in enumerate(files):
        inc = _incidents(path)
        layers = set(inc[~inc["module"].str.startswith("(")]["module"])
        assert layers == ({owners[rank]} if rank in owners else set()), inc
        if rank in owners:
            mine = inc[inc["module"] == owners[rank]]
            assert (mine["action"] == "dequantized").sum() == 1
            assert (mine["nan_count"] > 0).any()


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
