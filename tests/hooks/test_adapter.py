"""The capture core's engine seam (hooks/adapter.py), with an adapter of the test's own, the way
vLLM's works: the model's forward returns hidden states, and the "engine" then has a logits
processor apply the head's weights, without calling the head's forward. The adapter records that
call as the head's and its output as the step's logits, and ends the step there, touching the
session only through `AdapterCalls`."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from torch import nn

from qforensics.hooks.adapter import AdapterCalls, EngineAdapter
from qforensics.hooks.session import Capture
from qforensics.trace import schema
from qforensics.trace.reader import open_trace


class LogitsProcessor(nn.Module):
    def forward(self, head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(hidden, head.weight, head.bias)


class Body(nn.Module):
    """embedding -> two Linears; returns hidden states, not logits."""

    def __init__(self, vocab: int = 16, d: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, d)
        self.up = nn.Linear(d, d)
        self.down = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)  # its weights applied by the logits processor
        self.logits_processor = LogitsProcessor()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.emb(input_ids))))


class HeadAfterForward(EngineAdapter):
    logits_from_root = False

    def __init__(self, fail_at_step: int | None = None) -> None:
        self.began: list[int] = []
        self.session: AdapterCalls | None = None
        self.fail_at_step = fail_at_step

    def extra_modules(self, model, chosen):
        chosen = [m for _, m, _ in chosen]
        return [] if any(m is model.head for m in chosen) else [("head", model.head, "linear")]

    def attach(self, session: AdapterCalls) -> None:
        self.session = session
        model = session.model  # type: ignore[attr-defined]
        self.head_id = session.module_id(model.head)
        session.hook_output(model.logits_processor, self.on_logits)

    def step_began(self, session: AdapterCalls, args: tuple, kwargs: dict) -> None:
        if session.step == self.fail_at_step:
            raise RuntimeError("adapter bug")
        self.began.append(session.step)
        st = np.zeros(1, schema.engine_dtype("steps"))
        st["step"], st["n_rows"] = session.step, int(args[0].shape[-1])
        session.submit_engine(steps=st)

    def on_logits(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        s = self.session
        if s is None or not s.recording or not s.in_step:
            return
        ci = s.new_call()
        s.take(ci, self.head_id, schema.IO_INPUT, 0, args[1])
        s.take(ci, self.head_id, schema.IO_OUTPUT, 0, output)
        ci = s.new_call()
        s.take(ci, s.root_id, schema.IO_OUTPUT, 0, output)
        s.set_logits(output)
        s.end_step()


def _engine_step(model: Body, ids: torch.Tensor) -> torch.Tensor:
    return model.logits_processor(model.head, model(ids))  # logits after the forward


@pytest.mark.parametrize("modules", [None, ["up", "down"]])  # head hooked / added by the adapter
def test_an_adapter_ends_the_step_at_the_logits_it_records(tmp_path, modules):
    model, ad = Body(), HeadAfterForward()
    ids = [torch.tensor([[1, 2, 3]]), torch.tensor([[4]]), torch.tensor([[5]])]
    with torch.no_grad():
        ref = [_engine_step(model, x) for x in ids]
        with Capture(model, tmp_path / "t.h5", adapter=ad, modules=modules):
            got = [_engine_step(model, x) for x in ids]
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert ad.began == [0, 1, 2]
    with open_trace(tmp_path / "t.h5") as t:
        assert t.n_steps == 3 and t.end.complete
        for step, logits in enumerate(ref):
            s = t.steps.iloc[step]
            assert s["has_logits"] == 1
            assert s["logits_max"] == pytest.approx(float(logits.max()), rel=1e-6)
            assert s["logits_argmax"] == int(logits[0, -1].argmax())
            recs = t.records(step)
            head = recs[(recs.module == "head") & (recs.io == schema.IO_OUTPUT)].iloc[0]
            assert head["absmax"] == pytest.approx(float(logits.abs().max()), rel=1e-6)
            # the head's call (recorded by the adapter) after the body's Linears, the root last
            assert recs.drop_duplicates("call_index")["module"].tolist() == [
                "up", "down", "head", ""]
        assert t.modules["name"].tolist() == ["up", "down", "head", ""]
        engine = t.engine_table("steps")
        assert engine["step"].tolist() == [0, 1, 2]
        assert engine["n_rows"].tolist() == [3, 1, 1]


def test_the_step_lock_is_free_for_another_thread_after_a_step(tmp_path):
    # the root post-hook releases the step lock even when the adapter, not the root, ends the
    # step: a forward on another thread must not wait for ever
    model = Body()
    with torch.no_grad(), Capture(model, tmp_path / "t.h5", adapter=HeadAfterForward()):
        _engine_step(model, torch.tensor([[1, 2]]))
        done = threading.Event()

        def other() -> None:
            _engine_step(model, torch.tensor([[3]]))
            done.set()

        th = threading.Thread(target=other, daemon=True)
        th.start()
        th.join(timeout=60)
        assert done.is_set()
    with open_trace(tmp_path / "t.h5") as t:
        assert t.n_steps == 2


def test_an_adapter_error_degrades_capture_and_the_run_goes_on(tmp_path):
    model, ad = Body(), HeadAfterForward(fail_at_step=1)
    ids = torch.tensor([[1, 2]])
    with torch.no_grad():
        ref = _engine_step(model, ids)
        with Capture(model, tmp_path / "t.h5", adapter=ad) as cap:
            outs = [_engine_step(model, ids) for _ in range(3)]
            assert cap.degraded is not None and "adapter bug" in cap.degraded
    assert all(torch.equal(o, ref) for o in outs)
    with open_trace(tmp_path / "t.h5") as t:
        assert "adapter bug" in t.meta["status"]["capture_error"]
        assert t.steps["step"].tolist() == [0]  # the step before the error, and nothing after
