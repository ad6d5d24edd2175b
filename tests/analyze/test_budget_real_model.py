"""Issue 26's reproduction on the real SmolLM2-135M: greedy tokens under a budget the run
outgrows long before its failure; the failure after the budget was reached is still found.

Issue 26 ran 400 tokens against 120 MiB (a 16-step ring, 8-step windows); what is checked does
not depend on the length, only on the run outgrowing its budget long before the failure, so
the ring and windows are smaller and the run 120 tokens (issue 41: 88 s a test down to ~20).
The budget is reached at about step 15; the file must stay within it whatever the timing of
the writer's flushes (a failing run once wrote 43.1 MB under 40 MiB)."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

import qforensics  # noqa: E402
from qforensics.analyze import analyze_trace  # noqa: E402

pytestmark = pytest.mark.model

BUDGET = 40 << 20  # the ring (~10 MiB) and the reserved windows (~10 MiB) fit; little else
RING, WINDOW = 4, 2
N_TOKENS = 120
CORRUPT_AFTER = 90  # forwards; the planted NaN first shows in step 90 (step 0: prefill)


@pytest.fixture(scope="module")
def smollm2():
    from qforensics.demo.scenarios import DemoModel

    demo = DemoModel()  # the real model and the demo's prompt
    return demo.model, {"input_ids": demo.input_ids, "attention_mask": demo.attention_mask}


def _run(model, enc, path, corrupt: bool) -> None:
    weight = model.model.layers[17].self_attn.v_proj.weight
    saved = weight.detach().clone()
    forwards = [0]

    def pre(module, args, kwargs):
        forwards[0] += 1
        if corrupt and forwards[0] == CORRUPT_AFTER + 1:
            with torch.no_grad():
                weight[5, :] = float("nan")

    handle = model.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with qforensics.capture(model, path, max_bytes=BUDGET, ring_steps=RING,
                                trigger_window=WINDOW):
            with torch.inference_mode():
                model.generate(**enc, max_new_tokens=N_TOKENS, min_new_tokens=N_TOKENS,
                               do_sample=False)
    finally:
        handle.remove()
        with torch.no_grad():
            weight.copy_(saved)
    assert forwards[0] == N_TOKENS


def test_nan_after_the_budget_is_reached_is_found(smollm2, tmp_path):
    model, enc = smollm2
    p = tmp_path / "fail.h5"
    _run(model, enc, p, corrupt=True)
    assert os.path.getsize(p) <= BUDGET
    with qforensics.open_trace(p) as t:
        stopped = t.limits["reached_at_step"]
        assert 0 <= stopped < CORRUPT_AFTER  # the failure came after appending stopped
    f = analyze_trace(p)
    assert f.status == "FAILED" and f.exit_code == 1
    first = f.first_nonfinite
    assert first.step == CORRUPT_AFTER
    assert first.producer_module == "model.layers.17.self_attn.v_proj"
    assert f.cause.kind == "corrupted_parameters"
    bad = f.cause.tensors[0]
    assert bad["param"] == "weight" and bad["row"] == 5 and bad["nan"] == weight_row(model)
    assert f"first non-finite at step {CORRUPT_AFTER}" in f.verdict.line
    assert f"covers steps 0-{N_TOKENS - 1} ({N_TOKENS} steps)" in f.verdict.line


def weight_row(model) -> int:
    return int(model.model.layers[17].self_attn.v_proj.weight.shape[1])  # one row: in_features


def test_healthy_run_of_the_same_length_passes_with_its_coverage(smollm2, tmp_path):
    model, enc = smollm2
    p = tmp_path / "ok.h5"
    _run(model, enc, p, corrupt=False)
    assert os.path.getsize(p) <= BUDGET
    f = analyze_trace(p)
    assert f.status == "PASSED" and f.exit_code == 0, f.verdict.line
    assert f"no non-finite values in {N_TOKENS} steps" in f.verdict.line
    assert f"covers steps 0-{N_TOKENS - 1}" in f.verdict.line
    assert "stopped at step" in f.verdict.line
    assert f.coverage["steps_seen"] == N_TOKENS and f.coverage["resolution"] == 1
