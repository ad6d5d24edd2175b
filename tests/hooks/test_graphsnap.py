"""Compiled mode's snapshot (hooks/graphsnap.py; the stats op's `snap`): a weight row turned NaN
mid-run, under torch.compile, leaves the first failing call's input, output and weights in the
trace, as eager mode leaves them, and `qforensics replay` starts from them. Expectations come
from the model and a plain pre-hook of this test's own, never from the tool's output."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import qforensics
from qforensics.cli import main
from qforensics.hooks import graphlate

from capture_models import Tiny

NAN_STEP, ROW = 2, 3


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles a new Tiny: Dynamo's caches cleared before it (code compiled by
    earlier files' tests, without this file's pre-hook, would be reused) and after it (so
    that this file does not use up the recompile limit of Tiny.forward for later tests)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _run(path, steps: int, nan: bool, **kw) -> list[torch.Tensor]:
    """A compiled Tiny for `steps` steps; with `nan`, layers.1.down's weight row ROW turns NaN
    before step NAN_STEP (in place, as a stray store would). Returns the inputs that layer
    saw, one per step, from a forward pre-hook of its own."""
    model = Tiny()
    down = model.layers[1].down
    seen: list[torch.Tensor] = []
    down.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    compiled = torch.compile(model, dynamic=True)
    ids = torch.tensor([[1, 2, 3, 4]])
    with qforensics.capture(compiled, path, **kw), torch.no_grad():
        for step in range(steps):
            if nan and step == NAN_STEP:
                down.weight[ROW].fill_(float("nan"))
            logits = compiled(ids)
            nxt = int(torch.nan_to_num(logits[0, -1], nan=-1.0).argmax())
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    return seen


def test_compiled_run_keeps_the_first_failing_call_and_replay_reads_it(tmp_path):
    seen = _run(tmp_path / "c.h5", 4, nan=True)
    assert len(seen) == 4
    t = qforensics.open_trace(tmp_path / "c.h5")
    names = list(t.module_columns["name"])
    snaps = t.snapshots
    first = snaps[snaps["reason"] == "first_nonfinite_output"]
    assert len(first) and set(first["step"]) == {NAN_STEP}
    assert names[int(first["module_id"].iloc[0])] == "layers.1.down"
    call = int(first["call_index"].iloc[0])
    rec = t.records()
    mine = rec[(rec.call_index == call) & (rec.step == NAN_STEP)]
    assert set(mine.module_id) == {names.index("layers.1.down")}
    got = t.snapshot_tensors(call)
    assert {"input.0", "output.0", "weight", "bias", "call.json"} <= set(got)
    x = seen[NAN_STEP].reshape(-1, 16).numpy()
    np.testing.assert_allclose(np.asarray(got["input.0"]).reshape(-1, 16), x, rtol=1e-6)
    out = np.asarray(got["output.0"]).reshape(-1, 8)
    assert out.shape[0] == x.shape[0] and np.isnan(out[:, ROW]).all()
    assert np.isfinite(np.delete(out, ROW, axis=1)).all()
    w = np.asarray(got["weight"])
    assert w.shape == (8, 16) and np.isnan(w[ROW]).all() and np.isfinite(np.delete(w, ROW, 0)).all()
    st = t.meta["status"]
    assert "snapshots_compiled" not in st
    assert st["snapshot_compiled"]["taken"] is True and st["snapshot_compiled"]["truncated"] == []
    # replay reruns that call from the snapshot: the input is finite and the weight row holds
    # the NaN, so the fault is in the data, not the kernel; M = the step's rows (4 prompt
    # tokens + one a step), K x N = the layer's 16 x 8, column ROW NaN in every row
    r = CliRunner().invoke(main, ["replay", str(tmp_path / "c.h5"), "--sanitize", "off",
                                  "--json", str(tmp_path / "r.json")])
    assert r.exit_code in (0, 1), r.output  # the numeric leg only: no GPU wanted
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["call_index"] == call and doc["module"] == "layers.1.down"
    assert (doc["shapes"]["M_full"], doc["shapes"]["N_full"], doc["shapes"]["K"]) == \
        (4 + NAN_STEP, 8, 16)
    assert doc["tile"]["first_nonfinite"] == [0, ROW]
    assert doc["results"][0]["verdict"] == "DATA"


def test_healthy_compiled_run_keeps_no_snapshot(tmp_path):
    _run(tmp_path / "h.h5", 3, nan=False)
    t = qforensics.open_trace(tmp_path / "h.h5")
    assert len(t.snapshots) == 0
    st = t.meta["status"]["snapshot_compiled"]
    assert st["taken"] is False


def test_a_step_emitted_late_with_a_small_budget_keeps_leading_rows(tmp_path, monkeypatch):
    """A GPU emits each step at the end of the next (forced here); a budget of 200 bytes holds
    50 floats: 25 for the input (one 16-wide row), 25 for the output (three 8-wide rows)."""
    monkeypatch.setattr(graphlate, "LATE_ON_CPU", True)
    seen = _run(tmp_path / "s.h5", 4, nan=True, snapshot_budget=200)
    t = qforensics.open_trace(tmp_path / "s.h5")
    snaps = t.snapshots
    first = snaps[snaps["reason"] == "first_nonfinite_output"].set_index("name")
    assert first.loc["input.0", "truncated"] == 1 and first.loc["output.0", "truncated"] == 1
    got = t.snapshot_tensors(int(first["call_index"].iloc[0]))
    np.testing.assert_allclose(np.asarray(got["input.0"]), seen[NAN_STEP].reshape(-1, 16)[:1],
                               rtol=1e-6)
    assert np.asarray(got["output.0"]).shape == (3, 8)
    st = t.meta["status"]["snapshot_compiled"]
    assert st["taken"] is True and st["step"] == NAN_STEP
    assert st["truncated"] == ["input.0", "output.0"]
