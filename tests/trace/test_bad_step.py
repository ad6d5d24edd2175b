"""One meaning of "this step went bad" (trace.badstep), the same in every part that asks.

Traces are written through the project's own TraceWriter with tricky steps planted: a step bad
in its logits alone, a NaN in a warm-up forward only, a step whose logits and a record both go
bad. The expected answer is derived from what was planted; the writer's summaries and pinned
window, analyze's first bad step, coverage and verdict, the report's logits series and the
demo's check must all give it.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from qforensics.analyze import analyze_trace
from qforensics.analyze.coverage import find_coverage
from qforensics.analyze.engine import warmup_steps, without_warmup
from qforensics.analyze.nonfinite import find_first_bad_step
from qforensics.analyze.views import logits_series
from qforensics.demo.scenarios import first_nonfinite_step
from qforensics.trace import schema
from qforensics.trace.badstep import bad_steps, first_bad_row, first_bad_step, step_is_bad
from qforensics.trace.reader import open_trace

sys.path.insert(0, os.path.dirname(__file__))
from budget_batches import batch, engine_batch, writer  # noqa: E402

N_STEPS = 6

# name -> {step: (records bad, logits bad, warm-up)}; unlisted steps are healthy
PLANTS = {
    "logits_only": {3: (False, True, False)},
    "warmup_only": {0: (True, True, True)},
    "logits_and_record": {2: (True, True, False)},
    "warmup_then_logits": {0: (True, False, True), 4: (False, True, False)},
}


def _write(path, plant: dict[int, tuple[bool, bool, bool]]) -> None:
    w = writer(path, 16 << 20)
    for s in range(N_STEPS):
        rec_bad, logit_bad, warm = plant.get(s, (False, False, False))
        es = np.zeros(1, schema.engine_dtype("steps"))
        es["step"], es["warmup"] = s, int(warm)
        w.submit(engine_batch(steps=es))  # as vLLM's adapter: the step's tables come first
        # the flight recorder never marks a trigger on a warm-up forward
        b = batch(s, nan_module=7 if rec_bad else None, triggers=not warm)
        b.steps["logits_nan"] = 2 if logit_bad else 0
        if logit_bad and not rec_bad and not warm:
            trig = np.zeros(1, schema.trigger_dtype())
            trig["step"], trig["kind"], trig["value"], trig["kept"] = s, b"nonfinite", 2.0, 1
            b.triggers = trig
        w.submit(b)
    w.close()


def _expected(plant: dict[int, tuple[bool, bool, bool]]) -> tuple[list[int], list[int]]:
    """(bad steps, bad steps counting warm-ups), from what was planted."""
    every = sorted(s for s, (r, lg, _) in plant.items() if r or lg)
    return [s for s in every if not plant[s][2]], every


@pytest.mark.parametrize("name", list(PLANTS))
def test_every_part_finds_the_same_bad_steps(tmp_path, name):
    plant = PLANTS[name]
    bad, bad_with_warm = _expected(plant)
    first = bad[0] if bad else None
    p = tmp_path / f"{name}.h5"
    _write(p, plant)

    with open_trace(p) as t:
        warm = warmup_steps(t)
        assert sorted(warm.tolist()) == sorted(s for s, v in plant.items() if v[2])
        steps = t.step_table
        # the one predicate, both ways of the warm-up rule
        assert steps["step"][bad_steps(steps, warmup=warm)].tolist() == bad
        assert steps["step"][bad_steps(steps, count_warmup=True)].tolist() == bad_with_warm
        assert first_bad_step(steps, warmup=warm) == first
        # the same with the warm-ups given as one flag per row
        flags = np.isin(steps["step"], warm)
        assert first_bad_step(steps, warmup=flags) == first
        # the writer's summaries (every step, never thinned here)
        summ = t.summary_table
        assert int(summ["nonfinite_steps"].sum()) == len(bad)
        got = summ["first_nonfinite_step"][summ["first_nonfinite_step"] >= 0].tolist()
        assert got == bad
        assert int(summ["warmup"].sum()) == len(warm)
        # the writer's pinned window of the first failure
        pins = t.pinned_table
        pinned = [int(s) for s, k in zip(pins["step"], pins["kind"]) if str(k) == "nonfinite"]
        assert pinned == ([first] if first is not None else [])
        # analyze: its first bad step (warm-ups cleared or named), coverage, the report's view
        row = find_first_bad_step(without_warmup(steps, warm))
        assert (None if row is None else int(steps["step"][row])) == first
        row = find_first_bad_step(steps, warmup=warm)
        assert (None if row is None else int(steps["step"][row])) == first
        cov = find_coverage(t, without_warmup(steps, warm), warm)
        assert cov.first_nonfinite_step == first and cov.nonfinite_steps == len(bad)
        series = logits_series(t, None)
        assert series is not None and series.first_bad_step == first
    # the demo's check
    assert first_nonfinite_step(str(p)) == first
    # the whole analysis
    f = analyze_trace(p)
    if first is None:
        assert f.status != "FAILED", f.verdict.line
        return
    assert f.status == "FAILED", f.verdict.line
    rec_bad = plant[first][0]
    if rec_bad:
        fn = f.first_nonfinite
        assert fn is not None and fn.step == first
        assert fn.spread.n_steps == len([s for s in bad if s >= first])
    else:  # the logits alone: named as such, never a record that held nothing
        assert f.first_nonfinite is None
        assert f"the logits of step {first} hold" in f.verdict.line


def test_the_rule_reads_every_kind_of_step_table():
    """A structured array (the writer), a Table (analyze) and a DataFrame (the demo's readers)
    give one answer; a first non-finite record or call alone also says bad."""
    import pandas as pd

    from qforensics.trace.table import Table

    s = np.zeros(5, schema.step_dtype())
    s["step"] = np.arange(5)
    s["first_nonfinite_record"] = s["first_nonfinite_call"] = -1
    s["logits_inf"][1] = 1
    s["first_nonfinite_record"][2] = 0
    s["n_nonfinite_records"][3], s["first_nonfinite_call"][3] = 2, 9
    want = [False, True, True, True, False]
    table = Table({k: s[k] for k in s.dtype.names})
    frame = pd.DataFrame({k: s[k] for k in s.dtype.names if s[k].ndim == 1})
    for steps in (s, table, frame):
        assert bad_steps(steps).tolist() == want
        assert bad_steps(steps, warmup=[1]).tolist() == [False, False, True, True, False]
        assert bad_steps(steps, warmup=[1], count_warmup=True).tolist() == want
        assert first_bad_row(steps, warmup=[1, 2]) == 3
    assert step_is_bad(s[1:2]) and not step_is_bad(s[0:1]) and not step_is_bad(s[1:3])
    assert not step_is_bad(s[1:2], warmup={1}) and step_is_bad(s[1:2], warmup={1},
                                                                   count_warmup=True)
    with pytest.raises(ValueError):
        bad_steps(s, warmup=np.zeros(2, bool))
