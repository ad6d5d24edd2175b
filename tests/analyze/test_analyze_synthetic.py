"""Every branch of the analyzer on small synthetic traces with exact expected findings.

Layout of the synthetic model (3 layers): per step, calls are numbered 16*step + 5*layer + k with
k = 0 q_proj, 1 o_proj, 2 up_proj, 3 down_proj, 4 the block; call 16*step + 15 is the root.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from analyze_synth import make_trace

from qforensics.analyze import (
    FAILED,
    PASSED,
    SUSPECT,
    Gap,
    analyze_trace,
    analyze_traces,
)
from qforensics.errors import TraceFormatError, UsageError


def at(step, layer, module, stage, fn):
    def tamper(s, l, m, st, x):
        if (s, l, m, st) == (step, layer, module, stage):
            x = fn(x.copy())
        return x
    return tamper


def chain(*ts):
    def tamper(s, l, m, st, x):
        for t in ts:
            x = t(s, l, m, st, x)
        return x
    return tamper


def set_(idx, value):
    def fn(x):
        x[idx] = value
        return x
    return fn


def scale_channel(c, k):
    def fn(x):
        x[:, c] *= k
        return x
    return fn


def test_producer_with_outlier_channel(tmp_path):
    t = chain(at(1, 1, "mlp.down_proj", "in", scale_channel(7, 300.0)),
              at(1, 1, "mlp.down_proj", "out", set_((0, 3), np.nan)))
    f = analyze_trace(make_trace(str(tmp_path / "t.h5"), 4, tamper=t))
    assert f.verdict.status == FAILED
    assert f.verdict.line == ("FAILED | first non-finite at step 1, call 24: "
                              "model.layers.1.mlp.down_proj produced NaN from finite input")
    fn = f.first_nonfinite
    assert (fn.step, fn.call_index, fn.module, fn.tensor, fn.kind) == (
        1, 24, "model.layers.1.mlp.down_proj", "output", "nan")
    assert fn.producer == "model.layers.1.mlp.down_proj" and not fn.is_gap
    assert fn.nan_count == 1 and fn.inf_count == 0 and fn.input_absmax > 0
    # the NaN goes through the residual into every later module of step 1 only
    assert fn.spread.n_steps == 1 and fn.spread.n_steps_after == 3
    assert fn.spread.n_modules == 8 and fn.spread.logits_nonfinite_steps == 1
    o = f.outliers[0]
    assert (o.module, o.step, o.channel, o.first_step) == ("model.layers.1.mlp.down_proj", 1, 7, 1)
    assert o.ratio_to_median >= 20 and "ratio" in o.limits
    assert [p.step for p in o.trend] == [0, 1] and o.trend[1].absmax == pytest.approx(o.absmax)
    assert o.token is not None and o.token_is_peak_proxy
    assert f.outlier_step == 1 and f.damage_step == 1
    assert f.exit_code == 1


def test_gap_unhooked_op(tmp_path):
    t = at(0, 2, "self_attn.o_proj", "in", set_((2, 5), np.nan))
    f = analyze_trace(make_trace(str(tmp_path / "t.h5"), 2, tamper=t))
    fn = f.first_nonfinite
    assert fn.is_gap and fn.tensor == "input" and fn.call_index == 11
    assert isinstance(fn.producer, Gap)
    assert (fn.producer.last_finite_call, fn.producer.last_finite_module,
            fn.producer.first_bad_call, fn.producer.first_bad_module) == (
        10, "model.layers.2.self_attn.q_proj", 11, "model.layers.2.self_attn.o_proj")
    assert "only propagated it" in fn.producer.description
    assert f.verdict.line == (
        "FAILED | first non-finite at step 0, call 11: NaN already in the input of "
        "model.layers.2.self_attn.o_proj; produced by an unhooked op after call 10 "
        "(model.layers.2.self_attn.q_proj)")
    assert fn.producer_module is None


def test_gap_before_any_output(tmp_path):
    t = at(0, 0, "self_attn.q_proj", "in", set_((0, 0), np.inf))
    f = analyze_trace(make_trace(str(tmp_path / "t.h5"), 1, tamper=t))
    fn = f.first_nonfinite
    assert fn.is_gap and fn.call_index == 0 and fn.kind == "inf"
    assert fn.producer.last_finite_call is None
    assert f.verdict.line.endswith("Inf already in the input of model.layers.0.self_attn.q_proj; "
                                   "produced by an unhooked op before it")


def test_nan_at_step_13_after_logits_growth(tmp_path):
    grow = lambda s, l, m, st, x: x * (10.0 ** (s - 7)) if (m == "root" and 8 <= s <= 12) else x
    t = chain(grow, at(13, 0, "mlp.down_proj", "out", set_((0, 1), np.nan)))
    f = analyze_trace(make_trace(str(tmp_path / "t.h5"), 16, tamper=t))
    assert f.verdict.line == ("FAILED | first non-finite at step 13, call 211: "
                              "model.layers.0.mlp.down_proj produced NaN from finite input")
    growth = [p for p in f.precursors if p.kind == "logits_growth"]
    assert len(growth) == 1
    g = growth[0]
    assert g.step_to == 12 and g.step_from <= 8 and g.value >= 1e4 and not g.silent
    assert "before the first non-finite value at step 13" in g.line
    assert f.first_nonfinite.spread.n_steps == 1


def test_inf_without_nan(tmp_path):
    t = at(2, 0, "mlp.up_proj", "out", set_((0, 4), np.inf))
    f = analyze_trace(make_trace(str(tmp_path / "t.h5"), 3, tamper=t))
    fn = f.first_nonfinite
    assert (fn.step, fn.call_index, fn.kind, fn.nan_count, fn.inf_count) == (2, 34, "inf", 0, 1)
    assert f.verdict.line == ("FAILED | first non-finite at step 2, call 34: "
                              "model.layers.0.mlp.up_proj produced Inf from finite input")


def test_passed(tmp_path):
    f = analyze_trace(make_trace(str(tmp_path / "t.h5"), 5))
    assert f.verdict.status == PASSED and f.exit_code == 0
    assert f.verdict.line == "PASSED | no non-finite values in 5 steps"
    assert f.first_nonfinite is None and f.precursors == [] and f.end.complete
    assert len(f.damage) == 12 * 14  # 12 linear modules x 14 schemes
    d = f.to_dict()
    assert d["schema"] == "qforensics.analyze" and d["version"] == "1.0"
    json.dumps(d, allow_nan=False)


def test_damage_numbers_are_exact(tmp_path):
    def design(x):
        x[:] = 1.0
        x[:, 5] = 700.0
        return x
    f = analyze_trace(make_trace(str(tmp_path / "t.h5"), 2,
                                 tamper=at(0, 0, "self_attn.q_proj", "in", design)))
    assert f.damage_step == 0
    got = {d.scheme: d for d in f.damage if d.module == "model.layers.0.self_attn.q_proj"}
    assert got["int4-per-tensor"].scale == pytest.approx(100.0)
    assert (got["int4-per-tensor"].channels_zeroed, got["int4-per-tensor"].channels_total) == (63, 64)
    assert got["int4-per-tensor"].line == ("int4-per-tensor scale 100: 63 of 64 channels have "
                                           "absmax below scale/2 and quantize to zero")
    assert got["int8-per-tensor"].channels_zeroed == 63
    assert got["int4-per-token"].channels_zeroed == 63  # every token peaks at 700
    assert got["int4-g32"].channels_zeroed == 31 and got["int4-g64"].channels_zeroed == 63
    assert got["int8-g32"].channels_zeroed == 31
    assert got["fp8-e4m3"].overflow_count == 1 and got["fp8-e5m2"].overflow_count == 0
    assert got["fp8-e4m3-dynamic"].overflow_count == 0
    assert got["fp8-e4m3-dynamic"].scale == pytest.approx(700 / 448)
    unsafe = {u.scheme: u for u in f.unsafe}
    assert unsafe["int4-per-tensor"].modules[0].module == "model.layers.0.self_attn.q_proj"
    assert unsafe["fp8-e4m3"].modules[0].overflow_count == 1
    # no NaN: the outliers come from the module inputs with the largest ratios
    o = f.outliers[0]
    assert (o.module, o.channel, o.absmax) == ("model.layers.0.self_attn.q_proj", 5, 700.0)
    assert o.limits == ["ratio", "absolute", "fp8-e4m3"] and o.ratio_to_median == 700.0


def test_persistent_outlier_dim(tmp_path):
    t = lambda s, l, m, st, x: scale_channel(9, 60.0)(x.copy()) if m == "block" else x
    f = analyze_trace(make_trace(str(tmp_path / "t.h5"), 2, tamper=t))
    assert f.persistent and f.persistent[0].dim == 9
    assert f.persistent[0].modules >= 3


def test_repeat_loop_is_suspect(tmp_path):
    # steps 0-3 normal, then token 7 from step 4 with max |logit| at 5x: a broken scale
    p = make_trace(str(tmp_path / "t.h5"), 14, token_override=lambda s: 7 if s >= 4 else None,
                   logits_override=lambda s: {"logits_argmax": 7 if s >= 4 else s + 10,
                                              "logits_max": 50.0 if s >= 4 else 10.0,
                                              "logits_min": -1.0})
    f = analyze_trace(p)
    assert f.verdict.status == SUSPECT and f.exit_code == 1
    assert f.verdict.line == ("SUSPECT | no NaN, but token 7 repeated 10 times (argmax, steps "
                              "4-13) while max |logit| rose to x5 of its median before")


def test_confident_loop_without_a_scale_change_passes(tmp_path):
    # what healthy greedy decoding does ("8888...", docs/thresholds.md): no warning sign
    p = make_trace(str(tmp_path / "t.h5"), 14, token_override=lambda s: 7 if s >= 4 else None,
                   logits_override=lambda s: {"logits_argmax": 7 if s >= 4 else s + 10,
                                              "logits_max": 11.0, "logits_min": -1.0})
    f = analyze_trace(p)
    assert f.verdict.status == PASSED and f.precursors == [], f.verdict.line


def test_extreme_logits_and_outcome_are_suspect(tmp_path):
    from qforensics.trace.writer import set_meta
    p = make_trace(str(tmp_path / "t.h5"), 3,
                   tamper=lambda s, l, m, st, x: x * 5000 if m == "root" else x)
    f = analyze_trace(p)
    assert f.verdict.status == SUSPECT and f.precursors[0].kind == "extreme_logits"
    p2 = make_trace(str(tmp_path / "u.h5"), 3)
    set_meta(p2, "outcome", {"top1_agreement": 0.1, "text": "garbage"})
    f2 = analyze_trace(p2)
    assert f2.verdict.line == ("SUSPECT | no NaN, but only 10.0% of top-1 tokens agree with the "
                               "reference (outcome metadata, teacher-forced)")


TRUNCATE = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {here!r})
    import numpy as np
    from analyze_synth import TinyModel, run_model, write_trace
    batches = run_model(TinyModel(), 6)
    write_trace({path!r}, batches, 3, close=False)  # returns after the writer's flush barrier
    os._exit(0)  # like SIGKILL: no close, no status
""")


def test_truncated_trace(tmp_path):
    path = str(tmp_path / "crashed.h5")
    code = TRUNCATE.format(here=os.path.dirname(__file__), path=path)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    f = analyze_trace(path)
    assert not f.end.complete and f.end.last_step == 5
    # a run that died is never PASSED, even with no NaN in what it recorded
    assert f.verdict.line == ("SUSPECT | no non-finite values in 6 steps, but the run did not "
                              "finish normally: truncated: the writer never closed the file (the "
                              "run crashed or was killed); trace ends after step 5")
    assert any("truncated" in n for n in f.notes)


def test_truncated_datasets_mid_step(tmp_path):
    import h5py
    t = at(3, 1, "mlp.down_proj", "out", set_((0, 3), np.nan))
    path = make_trace(str(tmp_path / "t.h5"), 5, tamper=t)
    with h5py.File(path, "a") as h:  # cut /records inside step 4, drop the close status
        n = h["records/call_index"].shape[0]
        for k in h["records"]:
            h["records"][k].resize((n - 7,) + h["records"][k].shape[1:])
        del h["meta"].attrs["status"]
    f = analyze_trace(path)
    assert not f.end.complete and f.n_steps == 4 and f.end.last_step == 3
    assert f.verdict.line == ("FAILED | first non-finite at step 3, call 56: "
                              "model.layers.1.mlp.down_proj produced NaN from finite input "
                              "(trace truncated after step 3)")


def test_multi_rank_earliest(tmp_path):
    p0 = make_trace(str(tmp_path / "trace-0.h5"), 5, environment={"rank": 0, "world_size": 2},
                    tamper=at(3, 0, "mlp.down_proj", "out", set_((0, 0), np.nan)))
    p1 = make_trace(str(tmp_path / "trace-1.h5"), 5, environment={"rank": 1, "world_size": 2},
                    tamper=at(2, 2, "mlp.up_proj", "out", set_((0, 0), np.nan)))
    m = analyze_traces([p0, p1])
    assert [r.rank for r in m.ranks] == [0, 1]
    assert m.earliest == 1 and m.verdict.status == FAILED and m.exit_code == 1
    assert m.verdict.line.startswith(
        f"FAILED | earliest failure on rank 1 of 2 ({p1}): first non-finite at step 2, call 44: "
        "model.layers.2.mlp.up_proj produced NaN")
    assert m.verdict.line.endswith("also failed: rank 0")
    json.dumps(m.to_dict(), allow_nan=False)


def test_unreadable_and_bad_thresholds(tmp_path):
    bad = tmp_path / "x.h5"
    bad.write_bytes(b"not hdf5")
    with pytest.raises(TraceFormatError):
        analyze_trace(bad)
    with pytest.raises(UsageError):
        analyze_trace(make_trace(str(tmp_path / "t.h5"), 1), nonsense=3)
