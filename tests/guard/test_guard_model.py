"""The guard on the real SmolLM2-135M: the fp8-e4m3-nosat activation scenario (NaN from the
prefill without the guard) completes finite and close to the reference under the guard, and
its trips land as incidents in a captured trace."""

from __future__ import annotations

import pytest
import torch

import qforensics
from qforensics.quant import emulate_quantized_linears

MAX_NEW = 8


def _generate(model, tok, ids, **kw):
    with torch.inference_mode():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                              do_sample=False, temperature=None, top_p=None, top_k=None,
                              pad_token_id=tok.eos_token_id, **kw)


def _top1(model, full, n_prompt):
    with torch.inference_mode():
        logits = model(full).logits[0]
    pred = logits[n_prompt - 1:-1].argmax(-1)
    return logits, float((pred == full[0, n_prompt:]).float().mean())


@pytest.mark.model
def test_guarded_fp8_nosat_run_is_finite_close_to_reference_and_traced(demo, tmp_path) -> None:
    from qforensics.whatif.run import demo_prompt_ids

    model, tok = demo
    ids = demo_prompt_ids(tok)
    n = ids.shape[1]
    ref = _generate(model, tok, ids)
    assert ref.shape[1] > n
    path = tmp_path / "fp8-guarded.h5"
    with emulate_quantized_linears(model, "fp8-e4m3-nosat", exclude=("lm_head",)):
        with torch.inference_mode():  # the failure is real: NaN from the prefill
            assert torch.isnan(model(ids).logits).any()
        with qforensics.guard(model) as g:
            with qforensics.capture(model, path):
                out = _generate(model, tok, ids, return_dict_in_generate=True,
                                output_logits=True)
            incidents = g.stats.incidents
            assert all(torch.isfinite(step).all() for step in out.logits)
            assert g.stats.sanitized_steps == 0 and g.stats.repaired_steps >= 1
            assert "model.layers.11.mlp.down_proj" in g.stats.trips_by_module
            logits, agree = _top1(model, ref, n)  # modules already suspect: no rerun
        assert torch.isfinite(logits).all()
    assert agree >= 0.8, agree
    with qforensics.open_trace(path) as t:
        inc = t.incidents
    assert len(inc) == incidents > 0
    assert set(inc["action"]) <= {"fallback", "breaker_open", "breaker_fallback"}
    first = inc.iloc[0]
    assert first["module"] == "model.layers.11.mlp.down_proj" and int(first["step"]) == 0
    assert int(first["nan_count"]) > 0 and int(first["module_id"]) >= 0
