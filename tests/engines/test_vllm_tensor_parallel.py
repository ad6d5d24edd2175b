"""Tensor parallelism in the real engine: vLLM splits every layer over 3 workers (SmolLM2's 9
attention heads and 3 KV heads divide by 3, not by 2), each a process of its own; `record`
writes one trace per rank, named from vLLM's rank, and lists them all.

This machine has one NUMA node, for which vLLM's CPU backend refuses to place more than one
worker by itself; VLLM_CPU_OMP_THREADS_BIND gives each worker its cores (shared round robin
when there are fewer cores than workers)."""

from __future__ import annotations

import pytest

from qforensics.analyze.analyzer import analyze_trace
from qforensics.trace import schema
from qforensics.trace.reader import open_trace
from vllm_runs import TP, omp_binding

QKV = "model.layers.0.self_attn.qkv_proj"


@pytest.fixture(scope="module")
def tp_run(tp_healthy):
    return tp_healthy  # the session's one TP start of the bf16 model (conftest.py)


def test_binding_gives_every_worker_cores():
    parts = omp_binding(TP).split("|")
    assert len(parts) == TP and all(p for p in parts)


@pytest.mark.vllm
def test_one_trace_per_rank_listed_by_record(tp_run):
    names = [p.name for p in tp_run["files"]]
    assert names == [f"t-{r}.h5" for r in range(TP)]
    for p in tp_run["files"]:
        assert str(p.name) in tp_run["stderr"]


@pytest.mark.vllm
def test_each_trace_says_its_rank_and_holds_its_shard(tp_run):
    ins, outs = [], []
    for r, path in enumerate(tp_run["files"]):
        with open_trace(path) as t:
            eng = t.meta["environment"]["engine"]
            assert (eng["tp_rank"], eng["world_size"], eng["rank"]) == (r, TP, r)
            recs = t.records(step=0)
        mine = recs[recs["module"] == QKV]
        ins.append(float(mine[mine["io"] == schema.IO_INPUT]["absmax"].iloc[0]))
        outs.append(float(mine[mine["io"] == schema.IO_OUTPUT]["absmax"].iloc[0]))
    # a column-parallel layer sees the same (replicated) input on every rank and writes a
    # different slice of the output columns on each
    assert len(set(ins)) == 1
    assert len(set(outs)) > 1
    for path in tp_run["files"]:
        assert analyze_trace(path).status == "PASSED"
