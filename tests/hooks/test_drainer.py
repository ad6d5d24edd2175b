"""Compiled mode's drainer (hooks/drainer.py): the records of a compiled step are built in a
thread of their own, in step order, never lost to a ring slot reused too early, and a failure
there stops recording, not the run."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

import qforensics
from qforensics.analyze import PASSED, analyze_trace
from qforensics.hooks import graphlate, graphmode, graphstats, stepend
from qforensics.hooks.drainer import Drainer

from capture_models import Tiny, assert_same_channels, greedy_tokens


@pytest.fixture(autouse=True)
def _drainer_on(monkeypatch):
    """The drainer runs where the model is on a GPU (QFORENSICS_DRAIN=auto); here, forced."""
    monkeypatch.setattr(graphmode, "DRAIN", "thread")


def test_auto_drains_in_the_models_thread_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(graphmode, "DRAIN", "auto")
    greedy_tokens(torch.compile(Tiny(), dynamic=True), tmp_path / "t.h5", 2)
    st = qforensics.open_trace(tmp_path / "t.h5").meta["status"]
    assert st["capture_mode"] == "compiled" and "graph_drain" not in st


def test_items_run_in_order_off_the_calling_thread():
    seen: list[tuple[int, str]] = []
    d = Drainer(lambda i: seen.append((i, threading.current_thread().name)), depth=3)
    for i in range(50):
        d.put(i)
    assert d.flush(timeout=10)
    d.close(timeout=10)
    assert [i for i, _ in seen] == list(range(50))
    assert {name for _, name in seen} == {"qforensics-drain"}


def test_a_drainer_behind_hands_over_what_waits_in_one_call():
    """`many`: items queued while the thread was busy come in one call, in order, and
    never more than its depth."""
    gate, batches = threading.Event(), []

    def run_many(items):  # noqa: ANN001, ANN202
        gate.wait(10)
        batches.append(list(items))

    d = Drainer(run_many, depth=3, many=True)
    d.put(0)  # taken at once, held at the gate
    time.sleep(0.2)
    d.put(1)
    d.put(2)  # 3 in flight: the depth
    late = threading.Thread(target=d.put, args=(3,))
    late.start()
    late.join(0.3)
    assert late.is_alive()  # held back until the batch in hand is done
    gate.set()
    late.join(10)
    assert d.flush(timeout=10)
    d.close(timeout=10)
    assert batches[0] == [0] and [i for b in batches for i in b] == [0, 1, 2, 3]
    assert [1, 2] in batches or [1, 2, 3] in batches  # the waiting ones together
    assert max(len(b) for b in batches) <= 3


def test_put_waits_while_the_ring_would_be_overrun():
    """depth=2: two items may wait or run; a third `put` waits until one has finished."""
    gate = threading.Event()
    ran: list[int] = []

    def run(i: int) -> None:
        gate.wait(10)
        ran.append(i)

    d = Drainer(run, depth=2)
    d.put(0)
    d.put(1)
    third = threading.Thread(target=d.put, args=(2,))
    third.start()
    third.join(0.3)
    assert third.is_alive() and ran == []  # held back: item 0 still runs
    assert d.waits == 1
    gate.set()
    third.join(10)
    assert not third.is_alive()
    assert d.flush(timeout=10) and ran == [0, 1, 2]
    d.close(timeout=10)


def _until(pred, timeout: float = 10.0) -> float:  # noqa: ANN001
    """Wait until `pred()` holds; returns the seconds it took (fails past `timeout`)."""
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.005)
    return time.monotonic() - t0


def test_a_drainer_wakes_for_a_batch_its_linger_or_a_kick():
    """batch=3: two items wait untouched until a third comes, then the three run in one call;
    a lone item runs once it has waited `linger`, or at once when kicked."""
    got: list[list[int]] = []
    d = Drainer(lambda items: got.append(list(items)), depth=6, many=True, batch=3,
                linger=60.0)
    d.put(0)
    d.put(1)
    time.sleep(0.3)
    assert got == []
    d.put(2)
    _until(lambda: got == [[0, 1, 2]])
    d.put(3)
    time.sleep(0.3)
    assert got == [[0, 1, 2]]
    d.kick()
    _until(lambda: got == [[0, 1, 2], [3]])
    d.close(timeout=10)
    got.clear()
    d = Drainer(lambda items: got.append(list(items)), depth=6, many=True, batch=3,
                linger=0.4)
    t0 = time.monotonic()
    d.put(4)
    _until(lambda: got == [[4]])
    assert time.monotonic() - t0 >= 0.4
    d.close(timeout=10)


def test_a_failing_item_stops_the_drainer_and_drops_the_rest():
    def run(i: int) -> None:
        if i == 2:
            raise ValueError("bad slot")

    d = Drainer(run, depth=7)
    for i in range(5):
        d.put(i)
    assert d.flush(timeout=10)
    d.put(5)  # after the failure: dropped at once
    d.close(timeout=10)
    assert d.error == "ValueError: bad slot"
    assert d.dropped == 3  # items 3 and 4, then 5


def test_the_drained_trace_is_the_one_built_at_each_step_end(tmp_path, monkeypatch):
    """With the drainer (QFORENSICS_DRAIN=thread) and without (sync): the same tokens
    and the same trace; with it, every step's batch was built in the drainer's thread, none
    in the model's, and the last steps were drained at close."""
    builders: list[str] = []
    orig = stepend.build_batch

    def spy(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        builders.append(threading.current_thread().name)
        return orig(*a, **kw)

    monkeypatch.setattr(stepend, "build_batch", spy)
    graphmode.selftest(torch.device("cpu"))  # its one collect, before they are counted
    sizes: list[int] = []
    many = graphstats.GraphStats.collect_many

    def counted(self, items):  # noqa: ANN001, ANN202
        sizes.append(len(items))
        return many(self, items)

    monkeypatch.setattr(graphstats.GraphStats, "collect_many", counted)
    monkeypatch.setattr(graphmode, "DRAIN", "sync")
    monkeypatch.setattr(graphlate, "EMIT_LINGER", 1e9)  # by count only, whatever the speed
    monkeypatch.setattr(graphlate, "EMIT_BATCH", 1)  # each step at its end: the reference
    toks_s = greedy_tokens(torch.compile(Tiny(), dynamic=True), tmp_path / "sync.h5", 6)
    assert set(builders) == {threading.current_thread().name}
    assert sizes == [1] * 6
    builders.clear()
    sizes.clear()
    monkeypatch.setattr(graphlate, "EMIT_BATCH", 3)  # the model's thread, 3 steps at a time
    toks_3 = greedy_tokens(torch.compile(Tiny(), dynamic=True), tmp_path / "sync3.h5", 6)
    assert sizes == [3, 3]
    builders.clear()
    monkeypatch.setattr(graphmode, "DRAIN", "thread")
    toks_t = greedy_tokens(torch.compile(Tiny(), dynamic=True), tmp_path / "thread.h5", 6)
    assert toks_t == toks_s == toks_3
    assert builders == ["qforensics-drain"] * 6
    a = qforensics.open_trace(tmp_path / "sync.h5")
    assert "graph_drain" not in a.meta["status"]
    for other in ("thread.h5", "sync3.h5"):
        b = qforensics.open_trace(tmp_path / other)
        if other == "thread.h5":
            assert b.meta["status"]["graph_drain"]["thread"] is True
        assert b.steps["step"].tolist() == list(range(6))
        cols = ["step", "call_index", "module_id", "io", "slot", "rows", "channels",
                "nan_count", "min", "max", "mean", "std", "absmax", "tok_count"]
        np.testing.assert_array_equal(a.records()[cols].values, b.records()[cols].values)
        assert assert_same_channels(a, b)[0] > 0
        for f in ("first_call", "n_calls", "token_count", "logits_argmax",
                  "first_nonfinite_call"):
            assert a.steps[f].tolist() == b.steps[f].tolist(), f
        for s in range(6):
            np.testing.assert_array_equal(a.input_ids(s), b.input_ids(s))


@pytest.mark.parametrize("gpu_like", [False, True])
def test_a_slow_drainer_holds_the_model_back_instead_of_losing_steps(tmp_path, monkeypatch,
                                                                    gpu_like):
    """Records built slower than the model steps: the ring's slots are never overwritten
    before they are read (the model's thread waits): every step is in the trace, whole.
    `gpu_like`: as a GPU reads the ring (steps emitted a step late, from host copies of a
    4-slot ring and a 2-slot token ring): every record, token maxima included, is the one
    built at each step's end without a drainer."""
    if gpu_like:
        monkeypatch.setattr(graphmode, "DRAIN", "sync")
        greedy_tokens(torch.compile(Tiny(), dynamic=True), tmp_path / "ref.h5", 10)
        monkeypatch.setattr(graphmode, "DRAIN", "thread")
        monkeypatch.setattr(graphlate, "LATE_ON_CPU", True)
        monkeypatch.setattr(graphstats, "HOST_COPIES_ON_CPU", True)
    orig = graphstats.GraphStats.collect_many

    def slow(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        time.sleep(0.05)
        return orig(self, *a, **kw)

    monkeypatch.setattr(graphstats.GraphStats, "collect_many", slow)
    greedy_tokens(torch.compile(Tiny(), dynamic=True), tmp_path / "t.h5", 10)
    t = qforensics.open_trace(tmp_path / "t.h5")
    if gpu_like:
        ref = qforensics.open_trace(tmp_path / "ref.h5")
        assert t.meta["status"]["graph_ring"]["slots"] == graphstats.RING_SLOTS
        cols = ["step", "call_index", "module_id", "io", "slot", "rows", "min", "max",
                "absmax", "tok_count"]
        np.testing.assert_array_equal(t.records()[cols].values, ref.records()[cols].values)
        assert assert_same_channels(t, ref)[0] > 0
        # each step's input ids (one more each step) and logits figures, read with its slot
        # however far behind the drainer was: the steps' own, not a later step's
        for s in range(10):
            np.testing.assert_array_equal(t.input_ids(s), ref.input_ids(s))
        for f in ("token_count", "logits_argmax", "logits_min", "logits_max", "logits_mean",
                  "logits_entropy"):
            np.testing.assert_allclose(t.steps[f].values, ref.steps[f].values, rtol=1e-5,
                                       err_msg=f)
    st = t.meta["status"]
    assert st["graph_drain"]["waits"] > 0 and st["graph_drain"]["dropped"] == 0
    assert t.steps["step"].tolist() == list(range(10))
    rec = t.records()
    per_step = rec.groupby("step").size()
    assert (per_step == per_step.iloc[0]).all()  # the same calls, every step
    assert (rec.step.values >= 0).all()


def test_a_failure_in_the_drainer_stops_recording_not_thegreedy_tokens(tmp_path, monkeypatch):
    healthy = greedy_tokens(torch.compile(Tiny(), dynamic=True), tmp_path / "ok.h5", 6)
    orig = graphstats.GraphStats.collect_many

    def breaks(self, items):  # noqa: ANN001, ANN202 - several steps at once, when behind
        if any(step == 2 for step, _, _ in items):
            raise RuntimeError("slot unreadable")
        return orig(self, items)

    monkeypatch.setattr(graphstats.GraphStats, "collect_many", breaks)
    toks = greedy_tokens(torch.compile(Tiny(), dynamic=True), tmp_path / "t.h5", 6)
    assert toks == healthy  # the model ran on, its outputs untouched
    t = qforensics.open_trace(tmp_path / "t.h5")
    st = t.meta["status"]
    assert "slot unreadable" in st["graph_drain"]["error"]
    assert "slot unreadable" in st["capture_error"]
    assert t.steps["step"].tolist() == [0, 1]  # what was recorded before the failure
    f = analyze_trace(tmp_path / "t.h5")
    assert f.status != PASSED, f.verdict.line


@pytest.mark.parametrize("gpu_like", [False, True])
@pytest.mark.parametrize("drain", ["sync", "thread"])
def test_a_failing_step_is_emitted_at_its_end_not_with_its_batch(tmp_path, monkeypatch, drain,
                                                                  gpu_like):
    """EMIT_BATCH=16, no linger to speak of: healthy steps wait to be emitted together (the
    drainer wakes at 8); the step at which the op's first-failure word is set (a weight row
    overwritten with NaN in place) is emitted at its end, with the steps before it, in the
    model's thread or by the kicked drainer, so it is on its way to disk while the run goes
    on. `gpu_like` (the ring read through host copies, steps emitted a step late, as on a
    GPU): the word is read from the copy of the step before, so the failing step goes at the
    end of the next one. The trace still has every step, and its first bad step is that one."""
    monkeypatch.setattr(graphmode, "DRAIN", drain)
    monkeypatch.setattr(graphlate, "EMIT_BATCH", 16)
    monkeypatch.setattr(graphlate, "EMIT_LINGER", 1e9)
    if gpu_like:
        monkeypatch.setattr(graphlate, "LATE_ON_CPU", True)
        monkeypatch.setattr(graphstats, "HOST_COPIES_ON_CPU", True)
    emitted: list[int] = []
    orig = graphmode.GraphMode._graph_emit_many

    def spy(self, ns):  # noqa: ANN001, ANN202
        emitted.extend(n.step for n in ns)
        return orig(self, ns)

    monkeypatch.setattr(graphmode.GraphMode, "_graph_emit_many", spy)
    model = Tiny()
    comp = torch.compile(model, dynamic=True)
    seq = torch.tensor([[1, 2, 3, 4]])
    seen = 4 if gpu_like else 3  # the step whose end notices the failure
    with qforensics.capture(comp, tmp_path / "t.h5"), torch.no_grad():
        for i in range(6):
            if i == 3:
                model.layers[1].down.weight[0].fill_(float("nan"))
            comp(seq)
            if i == seen - 1:
                time.sleep(0.3)  # a drainer would have had time to take them
                assert emitted == []
            if i == seen:
                # the model's thread emits up to the failing step (a GPU's keeps the step
                # just ended for later); the kicked drainer takes all that waits
                _until(lambda: emitted == list(range(4 if drain == "sync" else seen + 1)))
    assert emitted == list(range(6))
    t = qforensics.open_trace(tmp_path / "t.h5")
    assert t.steps["step"].tolist() == list(range(6))
    f = analyze_trace(tmp_path / "t.h5")
    assert f.first_nonfinite is not None and f.first_nonfinite.step == 3
    assert f.first_nonfinite.producer == "layers.1.down"

if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
