"""Compiled mode (hooks/graphstats.py, hooks/graphmode.py): torch-op hooks that torch.compile
traces full-graph, their figures against numpy on the tensors themselves, and the capture
session built on them against the eager capture of the same model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import qforensics
from qforensics.errors import CaptureError
from qforensics.hooks import graphhooks, graphlate, graphmode, graphstats
from qforensics.trace import schema

from capture_models import Tiny, assert_same_channels, greedy_tokens


def _stats(tok_rows: int = 64):
    return graphstats.GraphStats(entries=16, tok_rows=tok_rows, device=torch.device("cpu"),
                                 channel_limit=8192, channel_io="all")


def _hooked_mlp(bound: int = 32):
    torch.manual_seed(1)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    gs = _stats()
    for mid, mod in enumerate((m[0], m[2])):
        mod.register_forward_hook(graphhooks.make_hook(gs, mid, False, bound, 4, 2),
                                  with_kwargs=True)
    return m, gs


def _expect(t: torch.Tensor) -> dict:
    """Figures of one tensor from numpy, finite values only (the trace's meaning)."""
    a = t.detach().double().numpy().reshape(-1, t.shape[-1])
    fin = np.isfinite(a)
    v = a[fin]
    lo = np.where(fin, a, np.inf).min(0)
    hi = np.where(fin, a, -np.inf).max(0)
    return {"min": v.min(), "max": v.max(), "mean": v.mean(), "std": v.std(),
            "nan": int(np.isnan(a).sum()), "inf": int(np.isinf(a).sum()), "rows": a.shape[0],
            "cmin": lo, "cmax": hi, "tok": np.abs(a).max(1)}  # NaN (Inf) rows read NaN (Inf)


@pytest.mark.parametrize("dynamic,spans", [(True, "c"), (False, "c"), (False, "slices")])
def test_compiled_hooks_match_numpy_full_graph(dynamic, spans, monkeypatch):
    from qforensics.hooks import fused

    real = None
    if spans == "c":  # fused_reduce.c, built at install time (or now)
        if not fused.REDUCER.ready():
            fused.REDUCER.wait()
        real = fused.REDUCER.spans()
        assert real is not None
    calls: list[int] = []

    def spans_fn(n, desc, out):  # noqa: ANN001, ANN202 - fused_reduce.c's qf_spans, counted
        calls.append(n)
        return real(n, desc, out)

    monkeypatch.setattr(fused.REDUCER, "spans", lambda: spans_fn if real is not None else None)
    m, gs = _hooked_mlp()
    f = torch.compile(m, fullgraph=True, dynamic=dynamic)  # a graph break would raise here
    for step, n in enumerate((5, 3, 7)):
        x = torch.randn(n, 16)
        if step == 2:
            x[1, 3] = float("nan")
            x[4, 0] = float("inf")
        gs.begin(step)
        with torch.no_grad():
            y = f(x)
            h = torch.nn.functional.linear(x, m[0].weight, m[0].bias)  # no hook runs
        part = gs.collect(step, 10, True)
        rec = part["records"]
        assert rec["call_index"].tolist() == [10, 10, 11, 11]
        assert rec["module_id"].tolist() == [0, 0, 1, 1]
        assert rec["io"].tolist() == [0, 1, 0, 1]
        for r, t in zip(rec, (x, h, torch.relu(h), y)):
            e = _expect(t)
            assert r["rows"] == n and r["channels"] == t.shape[-1]
            assert r["nan_count"] == e["nan"] and r["inf_count"] == e["inf"]
            np.testing.assert_allclose([r["min"], r["max"], r["mean"], r["std"]],
                                       [e["min"], e["max"], e["mean"], e["std"]],
                                       rtol=1e-4, atol=1e-5)
            o, w = r["chan_offset"], r["channels"]
            np.testing.assert_allclose(part["cmin"][o:o + w], e["cmin"], rtol=1e-6)
            np.testing.assert_allclose(part["cmax"][o:o + w], e["cmax"], rtol=1e-6)
            to, tc = r["tok_offset"], r["tok_count"]
            np.testing.assert_allclose(part["tok"][to:to + tc], e["tok"], rtol=1e-6)
        assert (rec["nan_count"][0] > 0) == (step == 2)
    # the channel ranges came through qf_spans (minima, maxima: 4 entries each), or slices
    assert calls == ([4, 4] * 3 if spans == "c" else [])


def test_a_module_that_did_not_run_is_not_reported():
    m, gs = _hooked_mlp()
    gs.begin(0)
    with torch.no_grad():
        m(torch.randn(2, 16))
    gs.begin(1)
    with torch.no_grad():
        m[0](torch.randn(2, 16))  # only the first layer runs in step 1
    rec = gs.collect(1, 0, True)["records"]
    assert rec["module_id"].tolist() == [0, 0]
    assert gs.collect(2, 0, True) is None  # step 2: nothing ran


def test_wider_than_its_bound_keeps_scalars_not_channels():
    m, gs = _hooked_mlp(bound=16)  # 32-wide tensors exceed it
    gs.begin(0)
    with torch.no_grad():
        m(torch.randn(3, 16))
    rec = gs.collect(0, 0, True)["records"]
    wide = rec["channels"] > 16
    assert wide.any() and (rec["chan_offset"][wide] == -1).all()
    assert (rec["chan_offset"][~wide] >= 0).all()
    assert np.isfinite(rec["max"][wide]).all()


def test_width_bound_reads_declared_sizes():
    lin = nn.Linear(1536, 576)
    assert graphhooks.width_bound(lin, 8192) == 1536
    assert graphhooks.width_bound(lin, 1000) == 1000
    blk = nn.Sequential(nn.Linear(8, 24), nn.Linear(24, 8))
    assert graphhooks.width_bound(blk, 8192) == 24


def test_entries_bound_by_what_each_forward_takes_positionally():
    """The token ring's columns (a GPU allocates them whole) are bounded by each module's
    positional inputs: a Linear one, a block two in all, a forward taking *args the most the
    hooks record; a module taking none still gets one (a hidden-state keyword)."""

    class Star(nn.Module):
        def forward(self, *xs):  # noqa: ANN002, ANN202
            return xs[0]

    class KwOnly(nn.Module):
        def forward(self, *, hidden_states):  # noqa: ANN001, ANN202
            return hidden_states

    mods = [nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)), Star(), KwOnly(), nn.Bilinear(2, 2, 2)]
    assert [graphhooks.positional_inputs(m) for m in (mods[0], mods[3], mods[4])] == [1, 1, 2]
    assert graphhooks.positional_inputs(mods[2]) >= 4
    assert graphhooks.max_entries(mods, [False, True, False, False, False], 4, 2) == \
        (1 + 2) + 2 + (4 + 2) + (1 + 2) + (2 + 2)


def test_capture_of_a_compiled_model_matches_eager_capture(tmp_path):
    eager_model = Tiny()
    toks_e = greedy_tokens(eager_model, tmp_path / "e.h5", 4)
    model = Tiny()
    compiled = torch.compile(model, dynamic=True)
    toks_c = greedy_tokens(compiled, tmp_path / "c.h5", 4)
    assert toks_c == toks_e
    te, tc = qforensics.open_trace(tmp_path / "e.h5"), qforensics.open_trace(tmp_path / "c.h5")
    st = tc.meta["status"]
    assert st["capture_mode"] == "compiled" and st["hook_path"] == "graph"
    assert st["graph_calls"] == len(te.modules) - 1  # every hooked layer but the root
    assert "graph_not_recorded" not in st  # the entries' bound left none without a place
    re, rc = te.records(), tc.records()
    for step in range(4):
        a = re[(re.step == step)].sort_values(["call_index", "io", "slot"])
        b = rc[(rc.step == step)].sort_values(["call_index", "io", "slot"])
        assert a[["module_id", "io", "slot", "rows", "channels"]].values.tolist() == \
            b[["module_id", "io", "slot", "rows", "channels"]].values.tolist()
        assert (a.call_index.values - a.call_index.values[0] ==
                b.call_index.values - b.call_index.values[0]).all()
        for f in ("min", "max", "mean", "absmax"):
            np.testing.assert_allclose(b[f].values, a[f].values, rtol=1e-4, atol=1e-5)
        sa, sb = te.steps.iloc[step], tc.steps.iloc[step]
        assert sb["has_logits"] == 1 and sb["logits_argmax"] == sa["logits_argmax"]
    assert tc.steps["first_nonfinite_call"].tolist() == [-1] * 4


def test_compiled_capture_finds_the_producer(tmp_path):
    model = Tiny()
    with torch.no_grad():
        model.layers[1].down.weight[2, 3] = float("nan")
    greedy_tokens(torch.compile(model, dynamic=True), tmp_path / "c.h5", 2)
    t = qforensics.open_trace(tmp_path / "c.h5")
    names = list(t.module_columns["name"])
    rec = t.records()
    s0 = t.steps.iloc[0]
    first = rec[rec.call_index == s0["first_nonfinite_call"]]
    assert names[int(first.module_id.iloc[0])] == "layers.1.down"
    inp = first[first.io == schema.IO_INPUT]
    assert (inp.nan_count == 0).all()  # it produced the NaN from finite input


def test_untraceable_torch_records_logits_only_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(graphmode, "_SELFTEST", {"cpu": "Unsupported: pretend"})
    model = Tiny()
    greedy_tokens(torch.compile(model, dynamic=True), tmp_path / "c.h5", 2)
    t = qforensics.open_trace(tmp_path / "c.h5")
    st = t.meta["status"]
    assert st["hook_path"] == "none" and "pretend" in st["graph_not_recorded"]
    assert t.steps["has_logits"].tolist() == [1, 1]
    rec = t.records()
    assert set(rec.module_id) == {len(t.modules) - 1}  # the root's logits only


def test_compiled_flag_must_be_a_bool(tmp_path):
    with pytest.raises(CaptureError):
        qforensics.capture(Tiny(), tmp_path / "x.h5", compiled="yes")


@pytest.mark.parametrize("nan,copies", [(False, False), (True, False), (True, True)])
def test_steps_emitted_a_step_late_match_those_emitted_at_once(tmp_path, monkeypatch, nan,
                                                              copies):
    """A GPU emits each compiled step at the end of the next one, from its slot of the ring
    (records, logits figures, input ids), so that no step waits on the device; forced here
    on the CPU, the trace must be the one written at once, the last step included (drained
    at close), NaN logits counted from the exact figures. With `copies`, the GPU's way of
    reading the ring too (graphstats.HOST_COPIES_ON_CPU): 4 device slots, 2 of the token
    ring, each step's slot and its token rows copied into host buffers and read from there,
    the channel ranges of ring steps from those copies."""
    def run(path, late: bool) -> list[int]:
        monkeypatch.setattr(graphlate, "LATE_ON_CPU", late)
        monkeypatch.setattr(graphstats, "HOST_COPIES_ON_CPU", late and copies)
        model = Tiny()
        if nan:
            with torch.no_grad():
                model.head.weight[5, 1] = float("nan")
        return greedy_tokens(torch.compile(model, dynamic=True), path, 5)

    assert run(tmp_path / "late.h5", True) == run(tmp_path / "now.h5", False)
    a, b = qforensics.open_trace(tmp_path / "now.h5"), qforensics.open_trace(tmp_path / "late.h5")
    assert b.steps["step"].tolist() == list(range(5))
    cols = ["step", "call_index", "module_id", "io", "slot", "rows", "channels", "nan_count",
            "inf_count", "min", "max", "mean", "std", "absmax"]
    pd_a, pd_b = a.records()[cols], b.records()[cols]
    np.testing.assert_array_equal(pd_a.values, pd_b.values)
    for f in ("first_call", "n_calls", "token_count", "has_logits", "logits_argmax",
              "logits_nan", "logits_inf", "first_nonfinite_call", "n_nonfinite_records"):
        assert a.steps[f].tolist() == b.steps[f].tolist(), f
    np.testing.assert_allclose(b.steps["logits_entropy"], a.steps["logits_entropy"],
                               rtol=1e-4)
    for s in range(5):
        np.testing.assert_array_equal(a.input_ids(s), b.input_ids(s))
    # every record's token maxima and kept channel ranges, as written at once
    assert assert_same_channels(b, a)[1] > 0
    if copies:
        ring = b.meta["status"]["graph_ring"]
        assert ring["slots"] == graphstats.RING_SLOTS and ring["host_slots"] > ring["slots"]
    # the logits' own NaN count, from the head's weights: row 5 is NaN at every position
    assert b.steps["logits_nan"].tolist() == ([1] * 5 if nan else [0] * 5)


def test_one_op_call_per_block_and_per_module_outside_blocks(tmp_path):
    """The layers' modules queue their tensors and the block's hook hands them to the op in
    one call: Dynamo's graph holds one call per block, one per module outside any block."""
    torch._dynamo.reset()  # earlier compiles of Tiny in this process: no cached graph
    calls: list[int] = []

    def counting(gm, example_inputs):  # noqa: ANN001, ANN202
        calls.append(sum(1 for n in gm.graph.nodes if "qforensics.stats" in str(n.target)))
        return gm

    model = Tiny()
    greedy_tokens(torch.compile(model, backend=counting, dynamic=True), tmp_path / "c.h5", 2)
    t = qforensics.open_trace(tmp_path / "c.h5")
    names = list(t.module_columns["name"])
    kinds = dict(zip(names, t.module_columns["kind"]))
    blocks = [n for n in names if kinds[n] == "block"]
    outside = [n for n in names if kinds[n] not in ("block", "root")
               and not any(n.startswith(b + ".") for b in blocks)]
    assert len(blocks) == 3 and outside == ["head"]  # the embedding is not hooked
    assert calls and calls[0] == len(blocks) + len(outside)
    rec = t.records()
    assert set(rec.module_id.unique()) == set(range(len(names)))  # root: the logits, outside


def test_calls_outside_the_graph_run_in_one_op_call_at_the_step_end():
    """vLLM's logits are recorded twice outside the graph (as lm_head's output and as the
    step's): queued, then handed to one op call when the step ends (which reduces a tensor
    given twice once: tests/hooks/test_statsop.py), each entry with their figures."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls: list[list] = []

    class OpCalls(TorchDispatchMode):  # every stats-op call, whichever kernel runs it
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if func is torch.ops.qforensics.stats.default:
                calls.append(list(args[0]))
            return func(*args, **(kwargs or {}))

    gs = _stats()
    gs.begin(0)
    torch.manual_seed(3)
    t = torch.randn(4, 32)
    with OpCalls():
        assert graphhooks.record_outside(gs, 5, schema.IO_INPUT, 0, 32, t)
        assert graphhooks.record_outside(gs, 6, schema.IO_OUTPUT, 0, 32, t)
        assert calls == []  # queued, not yet reduced
        graphhooks.flush_outside(gs)
    assert len(calls) == 1 and len(calls[0]) == 2
    assert all(x.data_ptr() == t.data_ptr() for x in calls[0]) and gs.queue == []
    part = gs.collect(0, 0, True)
    rec = part["records"]
    assert list(rec["module_id"]) == [5, 6]
    want = _expect(t)
    for r in rec:
        assert r["min"] == pytest.approx(want["min"]) and r["max"] == pytest.approx(want["max"])
        o = int(r["chan_offset"])
        np.testing.assert_allclose(part["cmax"][o:o + 32], want["cmax"], rtol=1e-6)


def test_status_counts_only_this_captures_numpy_redos(monkeypatch):
    """The CPU kernel's count of tensors left to numpy is the process's; a capture's status
    says what happened since it began, not what an earlier capture saw."""
    import collections

    from qforensics.hooks import statscpu

    monkeypatch.setattr(statscpu, "REDOS", collections.Counter({"float16": 3}))
    gs = _stats()
    try:
        assert "graph_numpy_redos" not in gs.status()
        statscpu.REDOS["float16"] += 2
        statscpu.REDOS["int8"] += 1
        assert gs.status()["graph_numpy_redos"] == {"float16": 2, "int8": 1}
    finally:
        gs.close()


@pytest.mark.parametrize("copies", [False, True])
def test_several_steps_collected_in_one_pass(copies, monkeypatch):
    """`collect_many`: the steps the drainer (or the CPU's sync path) hands over together,
    each step's part against numpy on its own tensors, whatever its rows, channel keeping and
    modules that ran; on the GPU's reading path too (host copies of each step)."""
    monkeypatch.setattr(graphstats, "HOST_COPIES_ON_CPU", copies)
    m, gs = _hooked_mlp()
    assert gs.copies == copies
    plan = [(5, True, True), (1, False, True), (3, True, False), (2, True, True)]
    seen = []
    for step, (n, keep, both) in enumerate(plan):
        x = torch.randn(n, 16)
        if step == 3:
            x[0, 2] = float("nan")
        gs.begin(step)
        with torch.no_grad():
            h = m[0](x)
            ts = [x, h] + ([torch.relu(h), m[2](torch.relu(h))] if both else [])
        gs.start_copy(step, n)
        seen.append(ts)
    parts = gs.collect_many([(s, 100 * s, keep) for s, (_, keep, _) in enumerate(plan)])
    for step, (part, (n, keep, both), ts) in enumerate(zip(parts, plan, seen)):
        rec = part["records"]
        assert rec["step"].tolist() == [step] * len(ts)
        assert rec["module_id"].tolist() == [0, 0, 1, 1][:len(ts)]
        assert rec["call_index"].tolist() == [100 * step] * 2 + [100 * step + 1] * (len(ts) - 2)
        for r, t in zip(rec, ts):
            e = _expect(t)
            assert r["rows"] == n and r["nan_count"] == e["nan"]
            np.testing.assert_allclose([r["min"], r["max"]], [e["min"], e["max"]], rtol=1e-6)
            to, tc = r["tok_offset"], r["tok_count"]
            assert tc == n
            np.testing.assert_allclose(part["tok"][to:to + tc], e["tok"], rtol=1e-6)
            if keep:
                o, w = r["chan_offset"], r["channels"]
                assert o >= 0
                np.testing.assert_allclose(part["cmin"][o:o + w], e["cmin"], rtol=1e-6)
                np.testing.assert_allclose(part["cmax"][o:o + w], e["cmax"], rtol=1e-6)
            else:
                assert r["chan_offset"] == -1 and not len(part["cmin"])
        assert len(part["tok"]) == n * len(ts)  # no other step's maxima in its array


class _Shared(nn.Module):
    """A layer run twice in one forward (weights shared), then a head; `brk`: a graph break
    between the two runs, so that Dynamo restarts its trace of the first part."""

    def __init__(self, brk: bool = False) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a, self.b, self.brk = nn.Linear(8, 8), nn.Linear(8, 4), brk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.brk:
            torch._dynamo.graph_break()
        return self.b(self.a(h))


@pytest.mark.parametrize("brk,compiled", [(False, True), (True, True), (False, False)])
def test_a_module_run_twice_keeps_a_record_per_run(brk, compiled):
    """Each run of a shared layer has its own entry, call index and figures (the first run's
    are not overwritten by the second's); a trace Dynamo restarts at a graph break places no
    entry twice (every entry is written every step). Eagerly, from the second step on, each
    run reuses the op calls its first step placed (graphhooks._eager_call): still one entry
    per run."""
    m = _Shared(brk)
    gs = _stats()
    for mid, mod in enumerate((m.a, m.b)):
        mod.register_forward_hook(graphhooks.make_hook(gs, mid, False, 8, 4, 2),
                                  with_kwargs=True)
    f = torch.compile(m, fullgraph=not brk) if compiled else m
    for step in range(3):
        x = torch.randn(3, 8)
        gs.begin(step)
        with torch.no_grad():
            f(x)
            lin = torch.nn.functional.linear  # the references, without the hooks
            h1 = lin(x, m.a.weight, m.a.bias)
            h2 = lin(h1, m.a.weight, m.a.bias)
            y = lin(h2, m.b.weight, m.b.bias)
        rec = gs.collect(step, 20, True)["records"]
        assert rec["module_id"].tolist() == [0, 0, 0, 0, 1, 1]
        assert rec["call_index"].tolist() == [20, 20, 21, 21, 22, 22]
        for r, t in zip(rec, (x, h1, h1, h2, h2, y)):
            e = _expect(t)
            np.testing.assert_allclose([r["min"], r["max"], r["mean"]],
                                       [e["min"], e["max"], e["mean"]], rtol=1e-5, atol=1e-6)
    assert len(gs.entries) == 6 and len(gs.call_order()) == 3


def test_compiled_capture_blames_the_run_of_a_shared_layer_that_made_the_inf(tmp_path):
    """A shared layer whose second run overflows to Inf (x 1e20 twice: 1e20 is finite, 1e40
    is not in float32; the head only passes it on): the first non-finite output is the
    second run's, from its finite input, and the snapshot kept is that run's call, in
    compiled mode as in eager, and with compiled mode's hooks on the eager model (the op
    called eagerly, its entries placed at every call)."""
    m = _Shared()
    with torch.no_grad():
        m.a.weight.copy_(torch.eye(8) * 1e20)
        m.a.bias.zero_()
    x = torch.full((2, 8), 1.0)
    for compiled, model in ((True, torch.compile(m)), (True, m), (False, m)):
        path = tmp_path / f"{compiled}-{model is m}.h5"
        with qforensics.capture(model, path, compiled=compiled), torch.no_grad():
            model(x)
        t = qforensics.open_trace(path)
        assert t.meta["status"]["capture_mode"] == "compiled"  # the op's hooks either way
        rec = t.records()
        a_id = list(t.module_columns["name"]).index("a")
        runs = rec[(rec.module_id == a_id) & (rec.io == schema.IO_OUTPUT)]
        assert len(runs) == 2, compiled  # each run its own record
        second = int(runs.call_index.max())
        assert t.steps.iloc[0]["first_nonfinite_call"] == second, compiled
        inp = rec[(rec.call_index == second) & (rec.io == schema.IO_INPUT)]
        assert len(inp) == 1 and inp.inf_count.iloc[0] == 0 and inp["max"].iloc[0] == 1e20
        snaps = t.snapshots
        kept = snaps[snaps["reason"] == "first_nonfinite_output"]
        assert set(kept["call_index"]) == {second}, compiled
        got = t.snapshot_tensors(second)
        np.testing.assert_allclose(np.asarray(got["input.0"]).reshape(-1, 8), 1e20, rtol=1e-6)


def test_a_traced_hook_holds_its_constants_in_its_code_not_in_closure_cells():
    """Dynamo guards every closure cell a traced hook reads, at every call of the compiled
    model (about six guards per hooked module); constants of the hook's code cost one guard
    on the code. The hooks keep no cells (bench/compiled_guards.py times the guards)."""
    gs = _stats()
    for flush in (True, False):
        hook = graphhooks.make_hook(gs, 3, False, 32, 4, 2, flush=flush)
        assert hook.__closure__ is None and hook.__defaults__ is None


def test_eager_calls_after_a_trace_reuse_its_entries():
    """Where Dynamo runs a traced model eagerly (its recompile limit reached, a region it
    skips), the hooks' eager calls write the entries the trace placed: no second set of
    entries, the same calls and call indices, figures from this step's tensors."""
    m, gs = _hooked_mlp()
    f = torch.compile(m, fullgraph=True)
    x0, x1 = torch.randn(3, 16), torch.randn(2, 16)
    gs.begin(0)
    with torch.no_grad():
        f(x0)
    gs.begin(1)
    with torch.no_grad():
        y = m(x1)  # eagerly: the hooks run as Python
    assert len(gs.entries) == 4
    rec = gs.collect(1, 7, True)["records"]
    assert rec["call_index"].tolist() == [7, 7, 8, 8]
    assert rec["rows"].tolist() == [2, 2, 2, 2]
    np.testing.assert_allclose(rec["max"][3], y.max().item(), rtol=1e-6)


class _WithComplex(nn.Module):
    """A forward whose first positional tensor is complex (no entry for the op), its second
    a float: the hook records the float input and the output."""

    def forward(self, c: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + c.real


def test_eager_hooks_skip_a_tensor_the_op_does_not_take_at_every_step():
    """A complex tensor among a call's tensors gets no entry (the status names it); the
    others keep theirs and their figures at every step, a dtype change (bfloat16 input) keeps
    the entry of its slot."""
    m = _WithComplex()
    gs = _stats()
    m.register_forward_hook(graphhooks.make_hook(gs, 0, False, 8, 4, 2), with_kwargs=True)
    for step, dt in enumerate((torch.float32, torch.float32, torch.bfloat16)):
        c = torch.randn(2, 3, dtype=torch.complex64)
        x = (torch.randn(2, 3) * (step + 1)).to(dt)
        gs.begin(step)
        with torch.no_grad():
            y = m(c, x)
        rec = gs.collect(step, 0, True)["records"]
        assert len(gs.entries) == 2
        assert rec["io"].tolist() == [schema.IO_INPUT, schema.IO_OUTPUT]
        assert rec["slot"].tolist() == [1, 0]
        for r, t in zip(rec, (x.float(), y.float())):
            e = _expect(t)
            np.testing.assert_allclose([r["min"], r["max"], r["mean"]],
                                       [e["min"], e["max"], e["mean"]], rtol=1e-5, atol=1e-6)
    # the trace says what it left out, once
    assert gs.status()["graph_not_recorded"] == [
        f"module 0 io {schema.IO_INPUT} slot 0: dtype complex64 not taken by the stats op"]


def test_a_step_copied_before_later_entries_were_placed_reads_what_it_ran(monkeypatch):
    """On a GPU a step's host copy holds the ring as far as entries were placed at its end;
    a module first run in a later step has its entry past that copy: reading the earlier
    step (in one pass with the later one, as a drainer behind does) reports what it ran."""
    monkeypatch.setattr(graphstats, "HOST_COPIES_ON_CPU", True)
    m, gs = _hooked_mlp()
    assert gs.copies
    gs.begin(0)
    with torch.no_grad():
        m[0](torch.randn(2, 16))  # the second layer not run yet: its entries not placed
    gs.start_copy(0, 2)
    gs.begin(1)
    with torch.no_grad():
        m(torch.randn(2, 16))
    gs.start_copy(1, 2)
    a, b = gs.collect_many([(0, 0, True), (1, 0, True)])
    assert a["records"]["module_id"].tolist() == [0, 0]
    assert b["records"]["module_id"].tolist() == [0, 0, 1, 1]
