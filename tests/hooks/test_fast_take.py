"""hooks/fast_take.c: a step plan's takes in C. The same steps run through PendingStep with the
C cursor and with Python takes only must give the same records, versions and reduced vectors;
the C run must really have taken in C; and what a record describes is the tensor as its hook
saw it (checked against numpy on copies made at take time), also when it changes in place
afterwards. Steps that leave their plan (another tensor, a strided one, another dtype, one
changed in place between its takes) exercise the hand-over to Python."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qforensics.hooks import fast_take, fused, planunpack
from qforensics.hooks.assemble import UniqueStats
from qforensics.hooks.pending import PendingStep


def _steps():
    """Per step: takes (ci, mid, io, slot, tensor or callable run at that point). Two linears
    a and b read one input x; b's output feeds c."""
    torch.manual_seed(0)
    out = []
    for s in range(8):
        x = torch.randn(2, 8)
        ya, yb = torch.randn(2, 6), torch.randn(2, 6)
        yc = torch.randn(2, 8)
        takes = [(0, 1, 0, 0, x), (0, 1, 1, 0, ya), (1, 2, 0, 0, x), (1, 2, 1, 0, yb),
                 (2, 3, 0, 0, yb), (2, 3, 1, 0, yc)]
        if s == 3:  # x changed in place between a's take and b's: b must not share a's copy
            takes.insert(2, ("mutate", x))
        if s == 4:  # c's output strided (same shape): Python copies it
            takes[5] = (2, 3, 1, 0, torch.randn(8, 2).t())
        if s == 5:  # another dtype at b's output: the plan misses there
            takes[3] = (1, 2, 1, 0, yb.to(torch.float64))
            takes[4] = (2, 3, 0, 0, takes[3][4])
        if s == 6:  # b reads another tensor than a
            takes[2] = (1, 2, 0, 0, x.clone())
        out.append(takes)
    return out


def _run(use_c: bool, monkeypatch, split: bool = False) -> tuple[list, list, PendingStep]:
    if not use_c:
        monkeypatch.setattr(fast_take, "TAKER", fast_take.FastTake(enabled=False))
    if not split:
        # the packed layout of the reduced vectors (what this test reads), not the split one
        monkeypatch.setattr(planunpack, "split_layout", lambda pl: None)
    else:  # the split layout: with the C cursor, takes reduce in their hooks
        _kernel_loaded()
    p = PendingStep()
    p.n_mod = 4
    p.track = True
    got, seen = [], []
    first = 0
    with torch.no_grad():
        for takes in _steps():
            p.start("k", first)
            copies = []
            for t in takes:
                if t[0] == "mutate":
                    t[1].mul_(3.0)
                    continue
                ci, mid, io, slot, ten = t
                copies.append(ten.double().numpy().copy())
                p.take(first + ci, mid, io, slot, ten)
            p.settle()
            meta, which, vers = p.record_arrays()
            plan, per_dev = p.reduce_on_device()
            if split:  # each unique tensor's figures, unpacked as the end of a step does
                host = _figures(p, plan, per_dev)
            else:
                host = torch.cat(per_dev[torch.device("cpu")]).numpy().copy()
            got.append((meta.tolist(), which.tolist(), list(vers), host, p.on_plan))
            seen.append((copies, which.tolist(), plan))
            p.learn()
            p.clear()
            first += 10
    monkeypatch.undo()
    return got, seen, p


def _same_steps(c_got: list, py_got: list) -> None:
    """Records, versions, reduced figures and on-plan flags equal, step by step."""
    assert len(c_got) == len(py_got)
    for k, (a, b) in enumerate(zip(c_got, py_got)):
        assert a[:3] == b[:3], f"step {k}"
        np.testing.assert_array_equal(a[3], b[3], err_msg=f"step {k}")
        assert a[4] == b[4], f"step {k}"


def test_c_takes_equal_python_takes(cursor_type, monkeypatch):
    c_got, c_seen, c_p = _run(True, monkeypatch)
    py_got, _, py_p = _run(False, monkeypatch)
    assert py_p._cursor is None and c_p._cursor is not None
    fast, slow, *_ = c_p._cursor.counts
    assert fast > 0  # the plan's steps took in C
    _same_steps(c_got, py_got)
    # on the plan to the end: 1 and 2 (step 0's plan), 4 (the plan learnt from step 3, where
    # b's input was a copy of its own: copying it again matches; the strided output goes
    # through Python's copy), 7 (step 6's plan); 3, 5 and 6 leave the plan they started on
    assert [g[4] for g in c_got] == [False, True, True, False, True, False, False, True]
    st = c_p.take_status()
    assert st["takes"] == "c" and st["c_takes"] == fast and st["python_takes"] == slow


def _figures(p: PendingStep, plan: list, per_dev: dict) -> np.ndarray:
    """Per unique tensor: min, max, mean, std, absmax, then its channel minima, maxima and row
    maxima, all in one vector (hooks/stepend.py's unpacking)."""
    n_u = len(p.column(0))
    need = np.ones(n_u, bool)
    st = UniqueStats(n_u, need)
    st.describe_all(p.column(3))
    host = {d: torch.cat(v).numpy() for d, v in per_dev.items()}
    split = p.split_out
    up = planunpack.unpacker(p.plan, plan, need, split is not None) if p.on_plan else None
    if up is not None:
        up.apply(st, host[plan[0][4]]) if plan else None
    else:
        st.unpack(plan, host, {d: 0 for d in host})
    if split is not None:
        split[0].apply(st, split[1])
    cmin, cmax, tok = st.cmin(), st.cmax(), st.tok()
    out = []
    for j in range(n_u):
        c, n = st.chan_off[j], st.chans[j]
        out += [st.sc[j], cmin[c:c + n], cmax[c:c + n], tok[st.tok_off[j]:st.tok_off[j]
                                                            + st.tok_cnt[j]]]
    return np.concatenate(out).astype(np.float64)


def _kernel_loaded() -> None:
    fused.REDUCER.parts(torch.zeros(2, 3, 4), 3, 4, True)  # loads (or starts building) it
    fused.REDUCER.wait()
    assert fused.REDUCER.split_ready(torch.float32), fused.REDUCER.off


def test_takes_reduced_in_their_hooks_equal_copies_reduced_at_the_end(cursor_type,
                                                                      monkeypatch):
    """With the split layout, the C cursor reduces each take where its hook runs (no copy);
    Python takes copy, and the end of the step reduces the copies. Same vectors, bit for bit,
    through every case of _steps: a strided take (that row reduced at the end from its copy),
    a plan left half-way (the figures of the reduced takes carried over), a mutation."""
    c_got, _, c_p = _run(True, monkeypatch, split=True)
    py_got, _, _ = _run(False, monkeypatch, split=True)
    _same_steps(c_got, py_got)
    assert [g[4] for g in c_got] == [False, True, True, False, True, False, False, True]
    st = c_p.take_status()
    assert st["hook_reductions"] > 0 and st["hook_copies"] == 0
    assert st["hook_reductions"] <= st["c_takes"]


def _nan_steps(bad_step: int):
    """Three calls per step (a reads x, b reads x too, c reads b's output); in `bad_step`,
    b's output holds a NaN; in the step after it, a's output reaches 1000."""
    torch.manual_seed(3)
    out = []
    for s in range(4):
        x, ya, yb, yc = torch.randn(3, 8), torch.randn(3, 6), torch.randn(3, 6), torch.randn(3, 8)
        if s == bad_step:
            yb[1, 2] = float("nan")
        if s == bad_step + 1:
            ya[0, 0] = 1000.0
        out.append([(0, 1, 0, 0, x), (0, 1, 1, 0, ya), (1, 2, 0, 0, x), (1, 2, 1, 0, yb),
                    (2, 3, 0, 0, yb), (2, 3, 1, 0, yc)])
    return out


def test_a_nonfinite_take_keeps_its_calls_tensors(cursor_type, monkeypatch):
    """A take reduced in its hook is not copied, unless it holds a NaN/Inf: then it and every
    other take of its call are (the exact pass and the snapshot read them), and only those."""
    _kernel_loaded()
    p = PendingStep()
    p.n_mod = 4
    p.track = False  # inference mode, as in vLLM
    p.copy_above = 500.0  # as the session sets it until the outlier snapshot is taken
    first = 0
    with torch.inference_mode():
        for s, takes in enumerate(_nan_steps(bad_step=2)):
            p.start("k", first)
            for ci, mid, io, slot, t in takes:
                p.take(first + ci, mid, io, slot, t)
            p.settle()
            if s >= 1:  # on the plan of step 0, reducing in the hooks
                assert p.on_plan and p.state is not None
                seen = p.column(4)
                _, which, _ = p.record_arrays()
                kept = [seen[j] is not None for j in which.tolist()]
                if s == 2:  # b's call (its input x is a's: shared), and c's: its input is
                    # yb again (a tensor of its own without version counters), with a NaN
                    assert kept == [True, False, True, True, True, True]
                    for rec in (0, 2, 3, 4, 5):
                        np.testing.assert_array_equal(seen[which[rec]].numpy(),
                                                      takes[rec][4].numpy())
                elif s == 3:  # a's call: an output past copy_above
                    assert kept == [True, True, True, False, False, False]
                else:
                    assert not any(kept)
            p.reduce_on_device()
            p.learn()
            p.clear()
            first += 10
    # x (for b's call), yb twice, yc; then x and ya
    assert p.take_status()["hook_copies"] == 6


def test_records_describe_the_tensor_as_its_hook_saw_it(cursor_type, monkeypatch):
    """The sum and sum of squares (fast_parts' first figures) of every unique tensor equal
    numpy's on the copy made at take time, on and off the plan."""
    got, seen, _ = _run(True, monkeypatch)
    for k, ((_, which, _, host, _), (copies, which2, plan)) in enumerate(zip(got, seen)):
        first_copy = {}
        for rec, j in enumerate(which):
            first_copy.setdefault(j, copies[rec])
        off = 0
        for idx, rows, chans, keep, _dev, size in plan:
            g = len(idx)
            flat = host[off:off + size]
            for i, j in enumerate(idx.tolist()):
                ref = first_copy[j]
                np.testing.assert_allclose(flat[i], ref.sum(), rtol=1e-5, atol=1e-5,
                                           err_msg=f"step {k} tensor {j}")
                np.testing.assert_allclose(flat[g + i], (ref * ref).sum(), rtol=1e-5,
                                           err_msg=f"step {k} tensor {j}")
            off += size
        assert off == len(host)
    # step 3: x was tripled after a's take; a's input keeps the old values, b's input is new
    copies3, which3, _ = seen[3]
    assert which3[0] != which3[2]
    np.testing.assert_allclose(copies3[2], 3.0 * copies3[0])


def test_cursor_rejects_malformed_plans(cursor_type):
    cur = cursor_type(lambda *a: None)
    with pytest.raises(ValueError):
        cur.begin((b"",) * 8, [None], None, 0, 1)
    with pytest.raises(ValueError):  # vers not as long as refs
        spec = (np.zeros(1, np.int64).tobytes(),) * 4 + (b"\x01", (torch.Size([1]),),
                                                          (torch.float32,), (torch.device("cpu"),))
        cur.begin(spec, [None], [0, 0], 0, 1)
    with pytest.raises(TypeError):
        cur.take(1, 2, 3)
    with pytest.raises(TypeError):
        cursor_type(42)
    assert not cur.active


def test_a_take_off_the_plan_goes_to_the_fallback(cursor_type):
    calls = []
    cur = cursor_type(lambda *a: calls.append(a))
    t = torch.ones(3)
    cur.take(0, 1, 0, 0, t)  # no plan begun: everything to Python
    assert len(calls) == 1 and calls[0][4] is t
    assert cur.counts == (0, 1, 0, 0, 0)
