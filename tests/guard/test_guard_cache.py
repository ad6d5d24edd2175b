"""KV caches the guard cannot roll back (transformers' sliding-window and static caches): no
exception escapes, the guard says what it cannot roll back (a ``no_rollback`` incident) and
locates producers with per-module checks instead. Real transformers caches on a small Mistral
built from a config (random weights, no hub)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qforensics.guard import guard
from qforensics.guard.cache import rollback, why_not_croppable


def _mistral(window: int = 4):
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        sliding_window=window, max_position_embeddings=64)
    torch.manual_seed(0)
    return MistralForCausalLM(cfg).eval(), cfg


class NoSatFp8Linear(nn.Linear):
    """An FP8-activation linear whose kernel does not saturate: |x / act_scale| > 448 -> NaN.
    ``act_scale`` is tiny, so every call trips."""

    def __init__(self, base: nn.Linear, act_scale: float = 1e-7):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.act_scale = act_scale
        self.qforensics_quant = {"format": "fp8-e4m3-nosat", "target": "activations"}

    def forward(self, x):
        xs = x / self.act_scale
        xq = torch.where(xs.abs() > 448, torch.full_like(xs, float("nan")), xs)
        return F.linear(xq * self.act_scale, self.weight, self.bias)


def test_full_sliding_window_cache_is_refused_before_cropping():
    from transformers import DynamicCache

    model, cfg = _mistral()
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 8)), past_key_values=cache, use_cache=True)
    why = why_not_croppable(cache)
    assert why is not None and "sliding-window layer 0" in why and "window 4" in why
    assert rollback(cache, 6) == why
    assert cache.get_seq_length() == 8  # untouched


def test_cache_within_its_window_rolls_back():
    from transformers import DynamicCache

    model, cfg = _mistral(window=16)
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 8)), past_key_values=cache, use_cache=True)
    assert rollback(cache, 6) is None and cache.get_seq_length() == 6


def test_crop_that_raises_is_reported_not_raised():
    class Odd:
        def get_seq_length(self):
            return 5

        def crop(self, n):
            raise RuntimeError("cannot")

    why = rollback(Odd(), 3)
    assert why.startswith("rolling back the KV cache (Odd) raised RuntimeError: cannot")
    assert rollback((("k", "v"),), 3) is None  # legacy tuple cache: untouched input


@pytest.mark.parametrize("impl", ["dynamic", "static"])
def test_generate_with_a_cache_it_cannot_roll_back(impl, caplog):
    model, _ = _mistral()
    mlp = model.model.layers[1].mlp
    mlp.down_proj = NoSatFp8Linear(mlp.down_proj)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    caplog.set_level(logging.WARNING, logger="qforensics.guard")
    kw = {"cache_implementation": "static"} if impl == "static" else {}
    with torch.no_grad(), guard(model) as g:
        out = model.generate(ids, max_new_tokens=6, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0, **kw)
    assert g.failed is None  # no exception escaped, the guard never went passive
    acts = [(i["module"], i["action"]) for i in g.incidents]
    assert acts[0] == ("(kv-cache)", "no_rollback")
    assert sum(a == "no_rollback" for _, a in acts) == 1  # said once
    detail = g.incidents[0]["detail"]
    assert "cannot be rolled back" in detail and "checks every guarded module" in detail
    assert "Sliding" in detail  # names the layer kind it cannot roll back
    assert ("model.layers.1.mlp.down_proj", "fallback") in acts  # located per module
    assert g.stats.reruns == 0
    # the producer is repaired from the call after it was located: later steps are finite
    # without sanitizing
    sanitized = {i["step"] for i in g.incidents if i["action"] == "sanitize_logits"}
    assert sanitized and max(sanitized) <= 1
    assert all(torch.isfinite(s).all() for s in out.scores)
    assert "cannot be rolled back" in caplog.text


def test_no_rollback_is_an_incident_in_the_trace(tmp_path):
    import qforensics

    model, _ = _mistral()
    mlp = model.model.layers[1].mlp
    mlp.down_proj = NoSatFp8Linear(mlp.down_proj)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    path = tmp_path / "cache.h5"
    with torch.no_grad(), qforensics.capture(model, path), guard(model) as g:
        model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with qforensics.open_trace(path) as t:
        inc = t.incidents
    assert len(inc) == len(g.incidents)  # every guard action is in the trace
    first = inc.iloc[0]
    assert (first.module, first.action) == ("(kv-cache)", "no_rollback")
    assert "cannot be rolled back" in first.detail
    assert "model.layers.1.mlp.down_proj" in set(inc.module)


def test_a_healthy_run_with_such_a_cache_has_no_incident():
    """Checking modules starts before the first failing step (so it can be located), but an
    incident is written only when a step actually needed a rollback."""
    model, _ = _mistral()
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), guard(model) as g:
        model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0,
                       cache_implementation="static")
        module_hooks = g.hooks_attached - 2  # beyond the two root hooks
    assert g.incidents == [] and g.stats.trips == 0 and g.failed is None
    assert module_hooks == len(g.names)  # per-module flags since the static window was seen
