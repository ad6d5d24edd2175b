"""What-if on a real trace of SmolLM2-135M: INT4 g128 with the 1% most salient input channels
(picked from the trace's recorded ranges) kept in FP16 beats INT4 per-tensor."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from qforensics.whatif.run import (
    parse_keep_salient,
    parse_target,
    parse_whatif_scheme,
    run_whatif,
)


@pytest.mark.model
def test_whatif_int4_g128_keep_salient_beats_per_tensor(demo, reference_trace) -> None:
    model, tok = demo
    lines: list[str] = []
    res = run_whatif(reference_trace,
                     [parse_whatif_scheme("int4-g128", parse_keep_salient("1%")),
                      "int4-per-tensor"],
                     model=model, tokenizer=tok, max_new_tokens=8, text_tokens=160,
                     progress=lines.append, target=parse_target("99.9%"))
    assert "recorded activation ranges of 210 Linears" in res.salient_source
    assert res.prompt_source.startswith("the trace's step-0 input ids")
    salient, per_tensor = res.schemes
    assert salient.scheme == "w:int4-g128-salient1pct"
    assert per_tensor.scheme == "w:int4-per-tensor"
    assert res.positions >= 4
    assert salient.top1 > per_tensor.top1
    assert salient.kl < per_tensor.kl and salient.ppl < per_tensor.ppl
    assert 0 < salient.recovered <= 1.5 and math.isfinite(res.ref_ppl)
    assert sum(line.startswith("[") for line in lines) == 2  # one progress line per scheme
    data = json.loads(json.dumps(res.to_json(), allow_nan=False))
    from qforensics.jsondoc import document
    from qforensics.schemas import validate

    assert validate(document("qforensics.whatif", data)) == []  # as `whatif --json` writes it
    assert [s["scheme"] for s in data["schemes"]] == ["w:int4-g128-salient1pct",
                                                      "w:int4-per-tensor"]
    assert "w:int4-g128-salient1pct" in res.format_table()
    # neither INT4 scheme keeps 99.9%: the closest is named, with the Linears the trace's
    # recorded ranges show the largest outliers in (max channel absmax / median channel)
    rec = data["recommendation"]
    assert rec["scheme"] is None and rec["closest"]["scheme"] == "w:int4-g128-salient1pct"
    assert rec["closest"]["value"] == pytest.approx(salient.recovered)
    from qforensics.whatif.salient import absmax_from_trace

    ratios = {}
    for name, a in absmax_from_trace(reference_trace).absmax.items():
        a = a[np.isfinite(a)].astype(np.float64)
        ratios[name] = a.max() / np.median(a)
    worst = sorted(ratios, key=lambda n: -ratios[n])[:3]
    keep = rec["needs"]["keep_bf16"]
    assert [k["module"] for k in keep] == worst
    assert keep[0]["times_median"] == pytest.approx(ratios[worst[0]], rel=1e-6)
    assert "would need: " + worst[0] + " in bf16" in res.format_table()
    # every weight is back: the reference is unchanged afterwards
    from qforensics.whatif.run import WhatIf

    again = WhatIf(model, tok, res_ids(reference_trace), max_new_tokens=8, text_tokens=160)
    assert again.ref_ppl == pytest.approx(res.ref_ppl, rel=1e-6)


def res_ids(trace):
    import torch

    import qforensics

    with qforensics.open_trace(trace) as t:
        return torch.as_tensor(t.input_ids(0))
