"""Parameters watched during the run (hooks/paramwatch.py, /param_watch, analyze's cause): a
weight row the test overwrites with NaN in place at step k, as a kernel's stray store would, is
named with its tensor, rows and first step; every expectation comes from what the test planted
(the tensor, the rows, the step, the check interval), never from the tool's output."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import qforensics
from qforensics.analyze import FAILED, analyze_trace

transformers = pytest.importorskip("transformers")

LAYER = "model.layers.1.mlp.down_proj"  # the tensor the tests corrupt


def _tiny() -> torch.nn.Module:
    """SmolLM2's architecture (Llama) at 2 small layers, random weights: no download."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).eval()


def _decode(model, run, path, steps: int, plant=None, at: int = -1, **kw) -> list[int]:
    """Greedy decode of a fixed-width window (a static shape, so a compiled model compiles
    once); `plant(model)` runs in place just before step `at`'s forward."""
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    toks = []
    with qforensics.capture(run, str(path), **kw), torch.no_grad():
        for step in range(steps):
            if step == at:
                plant(model)
            logits = run(input_ids=ids, use_cache=False).logits
            nxt = int(logits[0, -1].argmax())
            toks.append(nxt)
            ids = torch.cat([ids[:, 1:], torch.tensor([[nxt % 200]])], 1)  # ids < 200 only
    return toks


def _nan_rows(rows):
    def plant(model):
        model.get_submodule(LAYER).weight[rows] = float("nan")
    return plant


def _row(path, module: str, param: str = "weight"):
    w = qforensics.open_trace(path).param_watch
    hit = [i for i in range(len(w)) if w["module"][i] == module and w["param"][i] == param]
    assert len(hit) == 1, (module, param, list(w["module"]), list(w["param"]))
    return {c: w[c][hit[0]] for c in ("step", "last_finite", "trigger", "nan", "inf",
                                     "n_rows", "rows", "module_id")}


def test_row_overwritten_mid_run_is_named_at_its_step_by_the_trigger(tmp_path):
    model = _tiny()
    k, rows = 5, [37, 50]
    width = model.get_submodule(LAYER).weight.shape[1]
    _decode(model, model, tmp_path / "t.h5", 8, _nan_rows(rows), at=k, param_watch=1000)
    r = _row(tmp_path / "t.h5", LAYER)
    assert r["step"] == k and r["trigger"] == "nonfinite"  # the trigger: at step k itself
    assert r["last_finite"] == -1  # no interval check ran before (N = 1000)
    assert r["nan"] == len(rows) * width and r["inf"] == 0
    assert r["n_rows"] == len(rows) and list(r["rows"][:2]) == rows
    assert (r["rows"][2:] == -1).all()
    t = qforensics.open_trace(tmp_path / "t.h5")
    assert list(t.module_names).index(LAYER) == r["module_id"]

    f = analyze_trace(tmp_path / "t.h5")
    assert f.status == FAILED and f.first_nonfinite.step == k
    c = f.cause
    assert c.kind == "corrupted_parameters" and c.module == LAYER
    (tens,) = c.tensors
    assert tens["param"] == "weight" and tens["rows"] == rows and tens["row"] == rows[0]
    assert tens["first_seen_step"] == k and tens["during_run"]
    assert f"{LAYER}.weight rows {rows[0]}, {rows[1]} overwritten with NaN during the run " \
           f"(finite at attach; first seen at step {k})" in c.line


def test_a_check_of_a_step_built_late_is_labelled_with_the_step_it_read_at(tmp_path):
    """Compiled mode builds a step's records late (on the CPU in batches of EMIT_BATCH steps,
    on a GPU a step late): the interval check due at step 3 then runs at step 7's end, and
    reads the parameters as they are by then. Its row must say so: the Inf planted before
    step 6 was never there at step 3 (the label was the emitted step's: 'first seen at step
    3' for a row written at step 6)."""
    model = _tiny()
    n, k, row = 4, 6, 230

    def plant(m):
        m.model.embed_tokens.weight[row, 3] = float("inf")

    _decode(model, model, tmp_path / "t.h5", 12, plant, at=k, param_watch=n, compiled=True)
    with qforensics.open_trace(tmp_path / "t.h5") as t:
        assert t.meta["status"]["capture_mode"] == "compiled"
    r = _row(tmp_path / "t.h5", "model.embed_tokens")
    assert r["step"] >= k and r["last_finite"] < k and r["rows"][0] == row


def test_interval_check_finds_what_no_step_reads_within_n_steps(tmp_path):
    """A corrupt embedding row of a token never fed: every output stays finite, so no trigger;
    the check every N steps names it at the first check at or after k."""
    model = _tiny()
    n, k, row = 4, 6, 230  # the decode feeds ids < 200 only

    def plant(m):
        m.model.embed_tokens.weight[row, 3] = float("inf")

    _decode(model, model, tmp_path / "t.h5", 12, plant, at=k, param_watch=n)
    r = _row(tmp_path / "t.h5", "model.embed_tokens")
    first_check = k + (n - 1 - k % n)  # checks run at the end of steps n-1, 2n-1, ...
    assert r["step"] == first_check and r["step"] - k < n
    assert r["last_finite"] == first_check - n and r["trigger"] == "interval"
    assert (r["nan"], r["inf"], r["n_rows"], r["rows"][0]) == (0, 1, 1, row)
    assert r["module_id"] == -1  # the embedding is not a hooked module
    f = analyze_trace(tmp_path / "t.h5")  # it never reached an output: no failure, no cause
    assert f.status != FAILED and f.first_nonfinite is None and f.cause is None


def test_healthy_run_has_no_parameter_finding(tmp_path):
    model = _tiny()
    _decode(model, model, tmp_path / "t.h5", 9, param_watch=2)
    t = qforensics.open_trace(tmp_path / "t.h5")
    assert len(t.param_watch) == 0
    st = t.meta["status"]["param_watch"]
    assert st["every"] == 2 and st["checks"] == 9 // 2 + 1  # every 2 steps, and at close
    watched = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert st["tensors"] == len(watched) + 1  # every Linear's weight and the embedding
    f = analyze_trace(tmp_path / "t.h5")  # (random weights: near-uniform logits, SUSPECT)
    assert f.status != FAILED and f.first_nonfinite is None and f.cause is None


def test_old_trace_without_the_table_reads(tmp_path):
    import h5py

    model = _tiny()
    _decode(model, model, tmp_path / "t.h5", 3, _nan_rows([1]), at=1)
    with h5py.File(tmp_path / "t.h5", "a") as fh:
        del fh["param_watch"]  # as a trace written before the watch existed
    t = qforensics.open_trace(tmp_path / "t.h5")
    assert len(t.param_watch) == 0
    f = analyze_trace(tmp_path / "t.h5")
    assert f.status == FAILED and f.first_nonfinite.step == 1


def test_compiled_model_names_the_overwritten_row(tmp_path):
    model = _tiny()
    compiled = torch.compile(model)  # default mode, CPU
    k, rows = 3, [9]
    t0 = time.time()
    toks = _decode(model, compiled, tmp_path / "c.h5", 5, _nan_rows(rows), at=k,
                   param_watch=1000)
    assert time.time() - t0 < 120
    t = qforensics.open_trace(tmp_path / "c.h5")
    assert t.meta["status"]["capture_mode"] == "compiled"
    assert len(toks) == 5
    r = _row(tmp_path / "c.h5", LAYER)
    assert r["step"] == k and r["trigger"] == "nonfinite" and list(r["rows"][:1]) == rows
    f = analyze_trace(tmp_path / "c.h5")
    assert f.first_nonfinite.step == k
    assert f.cause.kind == "corrupted_parameters" and f.cause.module == LAYER
    assert f.cause.tensors[0]["rows"] == rows
    assert f"{LAYER}.weight row {rows[0]} overwritten with NaN" in f.cause.line
    assert np.isfinite(t.steps["logits_max"].to_numpy()[:k]).all()
