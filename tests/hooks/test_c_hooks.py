"""hooks/fast_take.c's Hook and Forward in a capture session: the C hooks record what the
Python hooks record, whether folded into the modules' forwards (the default) or registered as
torch hooks; an error in a C hook degrades capture, never the run; a folded forward keeps
torch's semantics (an exception still reaches the hook, then the caller; a hook's result replaces
the output) and is gone when the capture closes."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from qforensics.hooks import fast_take


class TupleOut(torch.nn.Module):
    """Like vLLM's linears: returns (output, bias)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor):
        return self.lin(x), None


class KwargOnly(torch.nn.Module):
    def forward(self, *, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states * 2.0


class DictOut(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> dict:
        return {"y": x + 1.0}


class Mixed(torch.nn.Module):
    """Every kind of call the C hook must do itself or hand to `_on_call`."""

    def __init__(self, d: int = 8, bad_at: int = -1) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a = torch.nn.Linear(d, d)
        self.t = TupleOut(d)
        self.k = KwargOnly()
        self.dct = DictOut()
        self.b = torch.nn.Linear(d, d)
        self.bad_at, self.calls = bad_at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls - 1 == self.bad_at:
            x = x.as_subclass(BadShape)
        h = self.a(x).as_subclass(torch.Tensor)
        h, _ = self.t(h)
        h = self.k(hidden_states=h)
        h = self.dct(h)["y"]
        return self.b(h.as_subclass(torch.Tensor))


class BadShape(torch.Tensor):
    @property
    def shape(self):  # what a broken tensor subclass could do inside a hook
        raise RuntimeError("no shape today")


def _capture_records(tmp_path, name: str, use_c: bool, monkeypatch, bad_at: int = -1,
                     hook_path: str = "auto"):
    import qforensics

    if not use_c:
        monkeypatch.setattr(fast_take, "TAKER", fast_take.FastTake(enabled=False))
    monkeypatch.setenv("QFORENSICS_HOOK_PATH", hook_path)
    m = Mixed(bad_at=bad_at)
    torch.manual_seed(5)
    xs = [torch.randn(2, 8) for _ in range(6)]
    path = tmp_path / f"{name}.h5"
    outs = []
    with torch.no_grad(), qforensics.capture(m, path, modules=["a", "t", "k", "dct", "b"], compiled=False) as cap:
        for x in xs:
            outs.append(m(x))
        assert cap._c_hooks == use_c
    monkeypatch.undo()
    with qforensics.open_trace(path) as t:
        recs = [t.records(s) for s in range(t.n_steps)]
        status = t.meta.get("status", {})
    return recs, status, outs


def test_c_hooks_record_what_python_hooks_record(cursor_type, tmp_path, monkeypatch):
    c_recs, c_status, _ = _capture_records(tmp_path, "c", True, monkeypatch)
    t_recs, t_status, _ = _capture_records(tmp_path, "t", True, monkeypatch, hook_path="torch")
    py_recs, py_status, _ = _capture_records(tmp_path, "py", False, monkeypatch)
    assert c_status["hooks"] == t_status["hooks"] == "c" and py_status["hooks"] == "python"
    assert c_status["hook_path"] == "forward"  # folded into the forwards
    assert t_status["hook_path"] == py_status["hook_path"] == "torch"  # registered hooks
    assert c_status["c_takes"] > 0 and "c_takes" not in py_status
    assert c_status["c_hook_calls"] > 0 and t_status["c_hook_calls"] > 0  # done whole in C
    assert len(c_recs) == len(t_recs) == len(py_recs) == 6
    for a, b, c in zip(c_recs, py_recs, t_recs):
        pd.testing.assert_frame_equal(a.reset_index(drop=True), b.reset_index(drop=True))
        pd.testing.assert_frame_equal(c.reset_index(drop=True), b.reset_index(drop=True))
    # every module's call is there: a, t, k (kwargs), dct (a dict), b, in each step
    names = set(c_recs[-1]["module"])
    assert {"a", "t", "k", "dct", "b"} <= names, names


def test_an_error_in_a_c_hook_degrades_capture_not_the_run(cursor_type, tmp_path,
                                                           monkeypatch):
    _, status, outs = _capture_records(tmp_path, "bad", True, monkeypatch, bad_at=4)
    assert len(outs) == 6 and all(torch.isfinite(o).all() for o in outs)
    assert "no shape today" in status.get("capture_error", ""), status
    assert status["c_hook_calls"] > 0  # step 4's `a` ran on the plan, in C


class NoClass:
    """An argument whose isinstance check raises (a broken proxy object)."""

    @property
    def __class__(self):
        raise RuntimeError("no class today")


class Tagged(torch.nn.Module):
    def forward(self, tag, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0


class WithTag(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.a = torch.nn.Linear(8, 8)
        self.w = Tagged()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.a(x)
        return self.w(NoClass() if self.calls == 5 else h.new_zeros(1), h)


def test_an_error_before_the_takes_degrades_capture_not_the_run(cursor_type, tmp_path):
    import qforensics

    m = WithTag()
    outs = []
    with torch.no_grad(), qforensics.capture(m, tmp_path / "t.h5", modules=["a", "w"], compiled=False) as cap:
        assert cap._c_hooks
        for _ in range(6):
            outs.append(m(torch.randn(2, 8)))
        assert cap._pending._cursor.counts[2] > 0  # earlier steps' calls ran in C
    assert len(outs) == 6
    with qforensics.open_trace(tmp_path / "t.h5") as t:
        status = t.meta.get("status", {})
    assert "no class today" in status.get("capture_error", ""), status


class Boom(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.fail:
            raise ValueError("boom")
        return y


def test_a_folded_forward_keeps_torch_semantics(cursor_type):
    """Forward(forward, module, hook) directly: the hook sees (module, args, kwargs, output),
    its result (when not None) replaces the output, it runs with None when forward raises and
    the exception still reaches the caller, and `off` leaves forward alone."""
    m = Boom()
    seen = []

    def hook(mod, args, kwargs, out):
        seen.append((mod, args, dict(kwargs), out))
        return None if out is None or not kwargs.get("double") else out * 2

    fwd = fast_take.TAKER.forward_type(m.forward, m, hook)
    x = torch.randn(2, 4)
    ref = m.lin(x)
    torch.testing.assert_close(fwd(x), ref)
    assert seen[-1][0] is m and seen[-1][1] == (x,) and seen[-1][2] == {}
    m.forward = fwd  # noqa: B010 - as wrap_forward sets it, but through nn.Module here
    with pytest.raises(TypeError):  # Boom.forward takes no `double`: it raises, the hook runs
        m(x, double=True)
    m.fail = True
    with pytest.raises(ValueError, match="boom"):
        m(x)
    assert seen[-1][3] is None and len(seen) == 3  # always_call: the hook ran, output None
    m.fail = False
    fwd.off = True
    n = len(seen)
    torch.testing.assert_close(m(x), ref)
    assert len(seen) == n  # off: forward only
    doubling = fast_take.TAKER.forward_type(lambda x, double=False: x + 1, m, hook)
    torch.testing.assert_close(doubling(x, double=True), (x + 1) * 2)  # the hook's result


def test_folded_forwards_are_gone_after_close(cursor_type, tmp_path):
    """capture folds its hooks into the forwards of the modules it hooks, except a module
    whose forward is already an instance attribute (another tool's wrapper): that one gets a
    torch hook. Closing leaves every module as it was."""
    import qforensics

    m = Mixed()
    own = m.b.forward

    def patched(x):  # like accelerate's hooks: a forward of the instance
        return own(x)

    m.b.forward = patched
    x = torch.randn(2, 8)
    with torch.no_grad():
        want = m(x)
        with qforensics.capture(m, tmp_path / "f.h5", modules=["a", "t", "k", "dct", "b"],
                                compiled=False):
            assert type(m.a.__dict__["forward"]) is fast_take.TAKER.forward_type
            assert m.b.__dict__["forward"] is patched and len(m.b._forward_hooks) == 1
            torch.testing.assert_close(m(x), want)
        for mod in (m.a, m.t, m.k, m.dct):
            assert "forward" not in mod.__dict__ and not mod._forward_hooks
        assert m.b.__dict__["forward"] is patched and not m.b._forward_hooks
        torch.testing.assert_close(m(x), want)
    with qforensics.open_trace(tmp_path / "f.h5") as t:
        assert set(t.records(0)["module"]) >= {"a", "t", "k", "dct", "b"}
