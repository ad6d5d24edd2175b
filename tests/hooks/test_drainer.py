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


def _gated():  # noqa: ANN202
    """(gate, ran, run): `run` appends its item to `ran` once `gate` is set."""
    gate = threading.Event()
    ran: list[object] = []

    def run(i: object) -> None:
        gate.wait(10)
        ran.append(i)

    return gate, ran, run


def test_put_waits_while_the_ring_would_be_overrun():
    """depth=2: two items may wait or run; a third `put` waits until one has finished."""
    gate, ran, run = _gated()
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


def test_put_spills_the_oldest_waiting_item_its_spill_function_takes():
    """depth=3, the first item held running: a put past the depth spills the oldest waiting
    item that `spill` takes (not one it declines, not the running one) and does not wait; the
    spilled item still runs, in its place in line, in its light form. Where `spill` takes
    none, put waits as before."""
    gate, ran, run = _gated()
    d = Drainer(run, depth=3)
    d.put(0)  # taken, held at the gate
    _until(lambda: d._busy == 1)
    d.put("keep")
    d.put(1)

    def light(i: object) -> object:
        return None if i == "keep" else f"light-{i}"

    d.put(2, spill=light)  # "keep" declined, 1 the oldest it takes: 3 held again
    assert (d.spills, d.waits) == (1, 0)
    blocked = threading.Thread(target=d.put, args=(3,), kwargs={"spill": lambda i: None})
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive()  # nothing it may spill: it waits
    gate.set()
    blocked.join(10)
    assert d.flush(timeout=10)
    d.close(timeout=10)
    assert ran == [0, "keep", "light-1", 2, 3] and (d.spills, d.waits) == (1, 1)
    assert d._held == 0  # every slot given back: spilled ones at once, the others once run


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
    # on a loaded machine the drainer can fall EMIT_BATCH steps behind, and then the oldest
    # finite step would give up its detail (test_a_slow_drainer_... checks that): here the
    # model's thread waits instead, so that the whole trace can be compared
    monkeypatch.setattr(graphlate.GraphLate, "_spill", lambda self, item: None)
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


def _slow_collect(monkeypatch, seconds: float) -> None:
    orig = graphstats.GraphStats.collect_many

    def slow(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        time.sleep(seconds)
        return orig(self, *a, **kw)

    monkeypatch.setattr(graphstats.GraphStats, "collect_many", slow)


def _gpu_like(monkeypatch) -> None:  # noqa: ANN001
    """The ring read as on a GPU: steps emitted a step late, from host copies of a 4-slot
    ring and a 2-slot token ring."""
    monkeypatch.setattr(graphlate, "LATE_ON_CPU", True)
    monkeypatch.setattr(graphstats, "HOST_COPIES_ON_CPU", True)


@pytest.mark.parametrize("gpu_like", [False, True])
def test_a_slow_drainer_spills_the_oldest_steps_instead_of_holding_the_model_back(
        tmp_path, monkeypatch, gpu_like):
    """Records built far slower than the model steps (0.3 s a batch): the model's thread
    does not wait for the drainer; the oldest waiting steps give up their ring detail
    instead (issue 39: the oldest steps' detail is lost, their summaries are not, and the
    trace says so). Every step has its row, in order; a spilled one reads `complete` 2 with
    no records, every other one holds exactly the records of a run without a drainer (the
    reference, built at each step's end); analyze reads what the reference reads (no gap)
    and names the spilled steps.
    On the CPU a spilled step keeps its input ids (the host noted them); `gpu_like`, they
    came with its slot and are gone with it."""
    n = 24
    monkeypatch.setattr(graphmode, "DRAIN", "sync")
    ref_toks = greedy_tokens(torch.compile(Tiny(), dynamic=True), tmp_path / "ref.h5", n)
    monkeypatch.setattr(graphmode, "DRAIN", "thread")
    if gpu_like:
        _gpu_like(monkeypatch)
    _slow_collect(monkeypatch, 0.3)  # far behind even a loaded machine's steps
    toks = greedy_tokens(torch.compile(Tiny(), dynamic=True), tmp_path / "t.h5", n)
    assert toks == ref_toks
    t = qforensics.open_trace(tmp_path / "t.h5")
    ref = qforensics.open_trace(tmp_path / "ref.h5")
    st = t.meta["status"]["graph_drain"]
    assert st["dropped"] == 0
    steps = t.steps
    assert steps["step"].tolist() == list(range(n))
    spilled = steps["step"][steps["complete"] == 2].tolist()
    kept = steps["step"][steps["complete"] == 1].tolist()
    assert st["spilled"] == len(spilled) > 0 and sorted(spilled + kept) == list(range(n))
    assert (steps["record_count"][steps["complete"] == 2] == 0).all()
    rec, ref_rec = t.records(), ref.records()
    ref_kept = ref_rec[ref_rec.step.isin(kept)]
    cols = ["step", "call_index", "module_id", "io", "slot", "rows", "min", "max", "absmax",
            "nan_count", "tok_count"]
    np.testing.assert_array_equal(rec[cols].values, ref_kept[cols].values)
    for f in ("first_call", "n_calls"):  # the host's own notes, spilled or not
        assert steps[f].tolist() == ref.steps[f].tolist(), f
    for s in spilled:
        assert len(t.input_ids(s)) == (0 if gpu_like else 4 + s)
    # the spilled steps are no gap (the toy model's random head may read near-uniform
    # logits: whatever the reference reads, this run reads, and says what it spilled)
    f, f_ref = analyze_trace(tmp_path / "t.h5"), analyze_trace(tmp_path / "ref.h5")
    assert f.status == f_ref.status, (f.verdict.line, f_ref.verdict.line)
    assert not any(w in f.verdict.line for w in ("no record", "missing", "damaged"))
    assert f"{len(spilled)} of {n} steps kept no per-module detail" in f.verdict.line


@pytest.mark.parametrize("gpu_like,word_late", [(False, False), (True, False), (True, True)])
def test_a_run_that_went_bad_keeps_its_detail_however_slow_the_drainer(tmp_path, monkeypatch,
                                                                        gpu_like, word_late):
    """A weight row overwritten with NaN at step 12 while the drainer lags: no step at or
    after the failure is spilled (a spill needs the op's first-failure word clear through the
    step), so analyze finds step 12 and its producer from records. `word_late`: as on a GPU
    whose copies of the word fall behind, the word of no step from 10 on is read in time:
    the failure is never seen at a step's end, and still no step past the last word read
    clear is spilled."""
    monkeypatch.setattr(graphmode, "DRAIN", "thread")
    if gpu_like:
        _gpu_like(monkeypatch)
    if word_late:
        orig = graphstats.GraphStats.copied_first
        monkeypatch.setattr(graphstats.GraphStats, "copied_first",
                            lambda self, step: None if step >= 10 else orig(self, step))
    _slow_collect(monkeypatch, 0.1)
    model = Tiny()
    comp = torch.compile(model, dynamic=True)
    seq = torch.tensor([[1, 2, 3, 4]])
    with qforensics.capture(comp, tmp_path / "t.h5"), torch.no_grad():
        for i in range(20):
            if i == 12:
                model.layers[1].down.weight[0].fill_(float("nan"))
            comp(seq)
    t = qforensics.open_trace(tmp_path / "t.h5")
    steps = t.steps
    assert steps["step"].tolist() == list(range(20))
    late = steps[steps["step"] >= 12]
    assert (late["complete"] == 1).all() and (late["record_count"] > 0).all()
    f = analyze_trace(tmp_path / "t.h5")
    assert f.first_nonfinite is not None and f.first_nonfinite.step == 12
    assert f.first_nonfinite.producer == "layers.1.down"


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
