"""Never PASSED over nothing: a trace whose hooked modules are missing from a step, or have no
records at all, reads SUSPECT, and the verdict names what is missing (issue 39, item 5).

The traces are written through the project's writer from the synthetic decoder; the gaps are
made by leaving records out of the batches before they are written, so what is missing is
known from what the test removed."""

from __future__ import annotations

import numpy as np
import pytest

from qforensics.analyze.analyzer import analyze_trace
from qforensics.trace.writer import StepBatch, TraceWriter
from analyze_synth import TinyModel, module_table, run_model

N_LAYERS = 2


def _without(b: StepBatch, drop: set[int]) -> StepBatch:
    """The batch with the records of the module ids in `drop` left out."""
    keep = ~np.isin(b.records["module_id"], list(drop))
    b.records = b.records[keep]
    b.steps = b.steps.copy()
    b.steps["record_count"] = len(b.records)
    return b


def _write(tmp_path, drop: dict[int, set[str]], *, extra: list[dict] | None = None,
           n_steps: int = 5, cut: set[int] = frozenset(),
           spilled: set[int] = frozenset()) -> str:
    """`cut`: steps whose row says they were cut short (complete 0), as a stop mid-forward
    leaves the last one; `spilled`: steps written as compiled mode writes a step whose ring
    detail it gave up (complete 2, no records)."""
    mods = module_table(N_LAYERS) + (extra or [])
    ids = {m["name"]: i for i, m in enumerate(mods)}
    batches = run_model(TinyModel(n_layers=N_LAYERS), n_steps)
    path = str(tmp_path / "t.h5")
    w = TraceWriter(path, modules=mods, environment={"rank": 0, "world_size": 1},
                    capture_options={}, flush_interval=0.05)
    for s, b in enumerate(batches):
        names = drop.get(s, drop.get(-1, set()))
        b = _without(b, {ids[n] for n in names})
        if s in cut:
            b.steps["complete"] = 0
        if s in spilled:
            b = _without(b, set(ids.values()))
            b.steps["complete"] = 2
        w.submit(b)
    w.close()
    return path


def test_a_full_trace_passes_and_has_no_gaps(tmp_path):
    f = analyze_trace(_write(tmp_path, {}))
    assert f.verdict.status == "PASSED", f.verdict.line
    assert f.coverage["gaps"]["line"] == ""


def test_steps_whose_detail_was_spilled_are_no_gap_but_are_said(tmp_path):
    """Steps 1 and 2 kept no records because compiled mode's ring overflowed (complete 2):
    the verdict stays PASSED, and its line says which steps and why."""
    f = analyze_trace(_write(tmp_path, {}, spilled={1, 2}))
    assert f.verdict.status == "PASSED", f.verdict.line
    assert "2 of 5 steps kept no per-module detail (steps 1, 2" in f.verdict.line
    assert f.coverage["gaps"]["spilled_steps"] == [1, 2]
    assert f.coverage["gaps"]["line"] == ""


def test_a_step_with_no_record_is_still_a_gap_next_to_spilled_ones(tmp_path):
    """The same, but step 3 lost its records without saying so (complete 1): SUSPECT."""
    every = {m["name"] for m in module_table(N_LAYERS)}
    f = analyze_trace(_write(tmp_path, {3: every}, spilled={1}))
    assert f.verdict.status == "SUSPECT", f.verdict.line
    assert "1 of 5 steps hold no record (steps 3)" in f.verdict.line
    assert "1 of 5 steps kept no per-module detail (steps 1" in f.verdict.line


def test_before_format_1_3_a_complete_of_2_is_damage(tmp_path):
    """A 1.2 writer never wrote a spilled step: there, 2 is a damaged value, not a reason to
    pass over a step without records."""
    import h5py

    path = _write(tmp_path, {}, spilled={1})
    with h5py.File(path, "r+") as h:
        h.attrs["format_version"] = "1.2"
    f = analyze_trace(path)
    assert f.verdict.status == "SUSPECT", f.verdict.line
    assert "/steps/complete[1] holds 2, outside its domain" in f.verdict.line


def test_a_module_missing_from_one_step_is_named(tmp_path):
    gone = "model.layers.1.mlp.down_proj"
    f = analyze_trace(_write(tmp_path, {3: {gone}}))
    assert f.verdict.status == "SUSPECT", f.verdict.line
    assert gone in f.verdict.line and "steps 3" in f.verdict.line
    assert f.coverage["gaps"]["missing_from_steps"] == {gone: [3]}


def test_a_module_never_recorded_is_named(tmp_path):
    gone = "model.layers.0.self_attn.q_proj"
    f = analyze_trace(_write(tmp_path, {-1: {gone}}))
    assert f.verdict.status == "SUSPECT", f.verdict.line
    assert f"1 of {len(module_table(N_LAYERS))} hooked modules have no record" in f.verdict.line
    assert f.coverage["gaps"]["never_recorded"] == [gone]


@pytest.mark.parametrize("n_steps", [1, 4])
def test_steps_with_no_record_at_all_never_pass(tmp_path, n_steps):
    """The compiled capture that never finished: steps, and no records."""
    every = {m["name"] for m in module_table(N_LAYERS)}
    f = analyze_trace(_write(tmp_path, {-1: every}, n_steps=n_steps))
    assert f.verdict.status == "SUSPECT", f.verdict.line
    assert "nothing was recorded" in f.verdict.line
    assert f"any of the {n_steps} steps" in f.verdict.line


def test_one_empty_step_among_full_ones_is_named(tmp_path):
    every = {m["name"] for m in module_table(N_LAYERS)}
    f = analyze_trace(_write(tmp_path, {2: every}))
    assert f.verdict.status == "SUSPECT", f.verdict.line
    assert "1 of 5 steps hold no record (steps 2)" in f.verdict.line


def test_an_expert_the_router_never_picked_is_no_gap(tmp_path):
    """Mixture-of-experts: an expert is called only for the tokens routed to it."""
    expert = {"name": "model.layers.0.mlp.experts.7.down_proj", "type": "Linear",
              "kind": "linear", "info": "{}"}
    f = analyze_trace(_write(tmp_path, {}, extra=[expert]))
    assert f.verdict.status == "PASSED", f.verdict.line


def test_a_forward_without_logits_is_no_gap(tmp_path):
    """An engine's dummy forward (vLLM's profile run) computes no logits: its lm_head and the
    root are not called; the steps with logits are the ones checked."""
    f = analyze_trace(_write(tmp_path, {2: {"", "model.layers.1.mlp.down_proj"}}))
    assert f.verdict.status == "PASSED", f.verdict.line


def test_a_last_step_cut_short_with_nothing_recorded_passes(tmp_path):
    """SIGTERM while the last step's forward began: that step's row (complete 0) holds no
    record, and the run still reads PASSED; the same empty step said whole is a gap."""
    every = {m["name"] for m in module_table(N_LAYERS)}
    f = analyze_trace(_write(tmp_path, {4: every}, cut={4}))
    assert f.verdict.status == "PASSED", f.verdict.line
    f = analyze_trace(_write(tmp_path, {4: every}))
    assert f.verdict.status == "SUSPECT" and "steps 4" in f.verdict.line, f.verdict.line


def test_a_step_cut_short_missing_modules_is_no_gap(tmp_path):
    gone = {"model.layers.1.mlp.down_proj", "model.layers.1.mlp.up_proj"}
    f = analyze_trace(_write(tmp_path, {4: gone}, cut={4}))
    assert f.verdict.status == "PASSED", f.verdict.line


def test_only_cut_steps_with_no_record_never_pass(tmp_path):
    every = {m["name"] for m in module_table(N_LAYERS)}
    f = analyze_trace(_write(tmp_path, {-1: every}, n_steps=2, cut={0, 1}))
    assert f.verdict.status == "SUSPECT" and "nothing was recorded" in f.verdict.line
