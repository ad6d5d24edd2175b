"""Replay end to end on the real SmolLM2: capture -> the real trace reader -> bundle -> rerun.

The failing layer is the project's FP8 e4m3 non-saturating fake-quant layer (a fixture, labelled
as one); expectations come from a plain forward hook on the same run, not from the tool.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.model

DOWN = "model.layers.11.mlp.down_proj"


def test_capture_reader_bundle_rerun_on_the_real_model(tmp_path):
    import torch

    import qforensics
    from qforensics.demo.model import load_model
    from qforensics.quant import emulate_quantized_linears
    from qforensics.replay.run import replay
    from qforensics.replay.verdict import Verdict

    model, tok = load_model()
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    seen: dict[str, torch.Tensor] = {}
    trace = tmp_path / "t.h5"
    with emulate_quantized_linears(model, "fp8-e4m3-nosat"):
        layer = model.get_submodule(DOWN)

        def keep_first_call(module, args, output):
            if "x" not in seen:
                seen["x"], seen["y"] = args[0].detach().clone(), output.detach().clone()

        handle = layer.register_forward_hook(keep_first_call)
        try:
            with torch.no_grad(), qforensics.capture(model, trace):
                model(ids)
        finally:
            handle.remove()
    x = seen["x"].double().reshape(-1, seen["x"].shape[-1]).numpy()
    y = seen["y"].reshape(-1, seen["y"].shape[-1]).float().numpy()
    out = replay(trace, gpu_probe=lambda: (False, "test"))
    b = out.bundle
    assert b.meta["module"] == DOWN and b.meta["module_type"] == "FakeQuantLinear" and b.meta["fixture"] is True
    # geometry from the model itself
    assert b.meta["K"] == layer.in_features and b.meta["N_full"] == layer.out_features
    assert b.meta["M_full"] == ids.shape[1] and b.meta["compute_dtype"] == "float32"
    c0, c1 = b.meta["col_start"], b.meta["col_stop"]
    np.testing.assert_array_equal(b.tensors["x"], x[b.meta["row_start"]:b.meta["row_stop"]].astype(b.tensors["x"].dtype))
    np.testing.assert_array_equal(np.isnan(b.observed), np.isnan(y[b.meta["row_start"]:b.meta["row_stop"], c0:c1]))
    np.testing.assert_array_equal(b.tensors["weight"], layer.weight.detach().numpy()[c0:c1])
    data = out.results[0]
    assert data.verdict is Verdict.DATA
    expected = sorted(int(c) for c in np.flatnonzero((np.abs(x) >= 464).any(axis=0)))  # e4m3 NaN threshold
    assert 1229 in expected
    assert sorted(c["channel"] for c in data.details["facts"]["overflowing_input_channels"]) == expected[:5]
    assert out.results[1].verdict is Verdict.INCONCLUSIVE
