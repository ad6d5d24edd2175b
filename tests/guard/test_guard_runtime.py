"""The runtime guard on tiny synthetic models: every branch (healthy, rerun repair, suspect
fallback, breaker, sanitize, raise, no-rerun blame, cache rollback, capture incidents, hook
hygiene)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import qforensics
from qforensics.guard import Guard, GuardError, GuardPolicy, GuardTripError, guard
from qforensics.quant import emulate_quantized_linears


class Tiny(nn.Module):
    """x -> l1 -> relu -> l2 -> relu -> head. With l1 under fp8-e4m3-nosat, any |x| > 448
    makes l1's output NaN (the failure the guard is for)."""

    def __init__(self, nan_op: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = nn.Linear(8, 8)
        self.l2 = nn.Linear(8, 8)
        self.head = nn.Linear(8, 5)
        self.nan_op = nan_op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.l1(x))
        if self.nan_op:  # an unguarded op that makes NaN from a large input
            h = torch.where(x.abs().amax(-1, keepdim=True) > 1e3, h * float("nan"), h)
        return self.head(torch.relu(self.l2(h)))


def ok_input() -> torch.Tensor:
    return torch.linspace(-2, 2, 24).reshape(3, 8)


def bad_input() -> torch.Tensor:
    x = ok_input().clone()
    x[1, 3] = 600.0  # beyond the e4m3 range: l1's quantized input is NaN for row 1
    return x


@pytest.fixture()
def tiny() -> Tiny:
    return Tiny()


def quant(model: nn.Module):  # only l1 quantized: the reference is then exact
    return emulate_quantized_linears(model, "fp8-e4m3-nosat", exclude=("l2", "head"))


def test_healthy_steps_cost_one_sync_and_no_module_hooks(tiny: Tiny) -> None:
    ref = tiny(ok_input())
    with quant(tiny), guard(tiny) as g:
        assert g.names == ["l1"]  # auto: the quantized linears only
        assert g.hooks_attached == 2  # root pre + post; no hook on healthy modules
        for _ in range(3):
            out = tiny(ok_input())
        assert torch.allclose(out, ref, atol=0.5)
    assert g.stats.steps == 3 and g.stats.host_syncs == 3
    assert g.stats.trips == 0 and g.incidents == []


def test_first_trip_is_repaired_by_rerunning_the_step(tiny: Tiny) -> None:
    ref = tiny(bad_input())
    with quant(tiny):
        assert not torch.isfinite(tiny(bad_input())).all()
        with guard(tiny) as g:
            out = tiny(bad_input())
            assert g.state("l1") == "suspect"
    assert torch.isfinite(out).all()
    assert torch.allclose(out[1], ref[1], atol=1e-6)  # the NaN row ran on the exact fallback
    assert g.stats.trips == 1 and g.stats.reruns == 1 and g.stats.repaired_steps == 1
    assert g.stats.sanitized_steps == 0
    (inc,) = g.incidents
    assert inc["module"] == "l1" and inc["action"] == "fallback" and inc["nan_count"] == 8


def test_suspect_module_uses_device_fallback_without_rerun(tiny: Tiny) -> None:
    ref = tiny(bad_input())
    with quant(tiny), guard(tiny) as g:
        tiny(bad_input())  # first trip: rerun
        syncs = g.stats.host_syncs
        out = tiny(bad_input())  # second trip: torch.where on device, counted at step end
        out_ok = tiny(ok_input())
    assert g.stats.reruns == 1
    assert g.stats.host_syncs == syncs + 2  # one per step
    assert torch.allclose(out[1], ref[1], atol=1e-6) and torch.isfinite(out_ok).all()
    assert g.stats.trips == 2 and g.stats.trips_by_module == {"l1": 2}
    assert [i["action"] for i in g.incidents] == ["fallback", "fallback"]
    assert g.stats.fallback_calls >= 3


def test_breaker_opens_after_n_trips_in_window_and_says_so(tiny: Tiny, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="qforensics.guard")
    with quant(tiny), guard(tiny, breaker_trips=2, breaker_window=4) as g:
        tiny(bad_input())
        tiny(bad_input())
        assert g.state("l1") == "breaker-open"
        out = tiny(bad_input())
        tiny(bad_input())
    assert torch.isfinite(out).all()
    actions = [i["action"] for i in g.incidents]
    assert actions == ["fallback", "fallback", "breaker_open", "breaker_fallback",
                       "breaker_fallback"]
    assert g.stats.breakers_open == ["l1"]
    assert sum("circuit breaker open" in r.message for r in caplog.records) == 1


def test_breaker_stays_closed_when_trips_are_spread_out(tiny: Tiny) -> None:
    with quant(tiny), guard(tiny, breaker_trips=2, breaker_window=2) as g:
        tiny(bad_input())
        tiny(ok_input())
        tiny(ok_input())
        tiny(bad_input())
        assert g.state("l1") == "suspect"
    assert g.stats.trips == 2 and g.stats.breakers_open == []


def test_breaker_open_module_returns_the_fallback_only(tiny: Tiny) -> None:
    ref = tiny(ok_input())
    with quant(tiny), guard(tiny, breaker_trips=1) as g:
        tiny(bad_input())
        assert g.state("l1") == "breaker-open"
        out = tiny(ok_input())  # even finite quantized outputs are replaced
    assert torch.allclose(out, ref, atol=1e-6)


def test_unguarded_nan_is_sanitized_as_last_resort(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="qforensics.guard")
    model = Tiny(nan_op=True)
    x = ok_input().clone()
    x[0, 0] = 2e3  # the unguarded op makes NaN; l1/l2/head are fine (no quantization)
    with guard(model) as g:
        out = model(x)
        out2 = model(x)
    assert torch.isfinite(out).all() and torch.isfinite(out2).all()
    assert g.stats.sanitized_steps == 2 and g.stats.trips == 0
    inc = [i for i in g.incidents if i["action"] == "sanitize_logits"]
    assert len(inc) == 2 and inc[0]["module"] == "(logits)" and inc[0]["nan_count"] == 5
    assert "does not cover" in inc[0]["detail"]
    assert sum("sanitized" in r.message for r in caplog.records) == 1  # logged once, counted all


def test_on_unrecoverable_raise() -> None:
    model = Tiny(nan_op=True)
    x = ok_input().clone()
    x[0, 0] = 2e3
    with guard(model, on_unrecoverable="raise") as g:
        with pytest.raises(GuardTripError, match="NaN"):
            model(x)
        assert g.hooks_attached == 2
        assert torch.isfinite(model(ok_input())).all()  # the next step is fine again


def test_check_modules_without_rerun_blames_the_producer_not_the_propagator(tiny: Tiny) -> None:
    ref = tiny(bad_input())
    with emulate_quantized_linears(tiny, "fp8-e4m3-nosat", exclude=("head",)):
        with guard(tiny, check="modules", rerun=False) as g:
            assert g.names == ["l1", "l2"] and g.hooks_attached == 4
            out0 = tiny(bad_input())  # caught at the step end: sanitized, l1 marked
            assert g.state("l1") == "suspect" and g.state("l2") == "healthy"
            syncs = g.stats.host_syncs
            out1 = tiny(bad_input())  # from now on l1 falls back on device
            assert g.stats.host_syncs == syncs + 1  # one per step
    assert g.stats.reruns == 0 and g.stats.sanitized_steps == 1
    assert torch.isfinite(out0).all() and torch.isfinite(out1).all()
    assert torch.allclose(out1[1], ref[1], atol=0.5)  # l2 still quantizes its input
    assert g.stats.trips_by_module == {"l1": 2}


def test_check_modules_with_rerun_repairs(tiny: Tiny) -> None:
    with quant(tiny), guard(tiny, check="modules") as g:
        out = tiny(bad_input())
    assert torch.isfinite(out).all() and g.stats.repaired_steps == 1, (g.failed, g.stats)


class CacheModel(nn.Module):
    """Appends its input rows to a KV-like cache passed as ``cache=`` (transformers 5 name)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Tiny()

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        if cache is not None:
            cache.append(x)
        return self.inner(x)


class Cache:
    def __init__(self, croppable: bool = True) -> None:
        self.rows: list[torch.Tensor] = []
        if not croppable:
            self.crop = None  # type: ignore[assignment]

    def append(self, x: torch.Tensor) -> None:
        self.rows.append(x)

    def get_seq_length(self) -> int:
        return sum(r.shape[0] for r in self.rows)

    def crop(self, n: int) -> None:
        assert n < 0
        keep = self.get_seq_length() + n
        out, total = [], 0
        for r in self.rows:
            take = max(0, min(r.shape[0], keep - total))
            if take:
                out.append(r[:take])
            total += take
        self.rows = out


def test_rerun_rolls_back_the_kv_cache() -> None:
    model = CacheModel()
    cache = Cache()
    with emulate_quantized_linears(model, "fp8-e4m3-nosat", exclude=("l2", "head")):
        with guard(model) as g:
            out = model(bad_input(), cache=cache)
    assert torch.isfinite(out).all() and g.stats.repaired_steps == 1, (g.failed, g.stats)
    assert cache.get_seq_length() == 3  # appended once, not twice


def test_cache_without_rollback_disables_rerun_and_switches_to_module_flags() -> None:
    model = CacheModel()
    cache = Cache(croppable=False)
    with emulate_quantized_linears(model, "fp8-e4m3-nosat", exclude=("l2", "head")):
        with guard(model) as g:
            out = model(bad_input(), cache=cache)
            assert g.stats.reruns == 0 and g.stats.sanitized_steps == 1
            assert "cannot be rolled back" in g.incidents[-1]["detail"]
            assert g.hooks_attached == 3  # now flags every guarded module
            model(bad_input(), cache=cache)  # caught by flags at the step end
            assert g.state("inner.l1") == "suspect"
            out2 = model(bad_input(), cache=cache)
    assert torch.isfinite(out).all() and torch.isfinite(out2).all()


def test_fp16_linear_fallback_recomputes_in_float32() -> None:
    lin = nn.Linear(4, 2).half()
    with torch.no_grad():
        lin.weight.fill_(200.0)
        lin.bias.zero_()
    model = nn.Sequential(lin)
    x = torch.full((1, 4), 100.0, dtype=torch.float16)  # 4 * 100 * 200 = 80000 > fp16 max
    assert torch.isinf(model(x)).all()
    with guard(model, modules="linear") as g:
        out = model(x)
    assert torch.isfinite(out).all() and float(out.detach().max()) == 65504.0
    assert g.stats.repaired_steps == 1


def test_incidents_land_in_the_captured_trace(tiny: Tiny, tmp_path) -> None:
    path = tmp_path / "t.h5"
    with quant(tiny), qforensics.capture(tiny, path), guard(tiny):
        tiny(ok_input())
        tiny(bad_input())
    with qforensics.open_trace(path) as t:
        inc = t.incidents
    assert list(inc["action"]) == ["fallback"]
    assert list(inc["module"]) == ["l1"] and int(inc["step"].iloc[0]) == 1
    assert int(inc["nan_count"].iloc[0]) == 8


def test_hooks_removed_on_exit_and_on_exception(tiny: Tiny) -> None:
    before = {n: (dict(m._forward_hooks), dict(m._forward_pre_hooks), set(vars(m)))
              for n, m in tiny.named_modules()}
    with quant(tiny):
        with guard(tiny) as g:
            tiny(bad_input())
            assert g.hooks_attached == 3
        assert g.hooks_attached == 0
        with pytest.raises(RuntimeError, match="boom"):
            with guard(tiny, check="modules") as g2:
                assert g2.hooks_attached == 3
                raise RuntimeError("boom")
        assert g2.hooks_attached == 0
    after = {n: (dict(m._forward_hooks), dict(m._forward_pre_hooks), set(vars(m)))
             for n, m in tiny.named_modules()}
    assert after == before  # no hook left, no attribute written onto the modules


def test_forward_raising_inside_guard_leaves_it_usable(tiny: Tiny) -> None:
    with quant(tiny), guard(tiny) as g:
        with pytest.raises(RuntimeError):
            tiny(torch.zeros(2, 3))  # shape error inside forward
        out = tiny(bad_input())
    assert torch.isfinite(out).all() and g.stats.repaired_steps == 1, (g.failed, g.stats)


def test_refuses_double_attach(tiny: Tiny) -> None:
    with guard(tiny, modules="linear"):
        with pytest.raises(GuardError, match="already attached"):
            with guard(tiny, modules="linear"):
                pass
    with guard(tiny, modules="linear"):  # released after exit
        pass


def test_internal_error_makes_the_guard_passive_not_the_run_crash(tiny: Tiny, caplog) -> None:
    bad_w = {"l1": torch.zeros(3, 3)}  # wrong shape: the fallback raises
    with quant(tiny), guard(tiny, fallback_weights=bad_w) as g:
        out = tiny(bad_input())
        out2 = tiny(ok_input())
    assert g.failed and "mat1 and mat2" in g.failed
    assert torch.isfinite(out).all()  # that step still ends sanitized (counted)
    assert torch.isfinite(out2).all()
    assert any("goes passive" in r.message for r in caplog.records)


def test_policy_and_selection_errors(tiny: Tiny) -> None:
    with pytest.raises(GuardError, match="check"):
        guard(tiny, check="sometimes")
    with pytest.raises(GuardError, match="breaker_trips"):
        guard(tiny, policy={"breaker_trips": 0})
    with pytest.raises(GuardError, match="unknown guard policy field"):
        guard(tiny, policy={"nope": 1})
    with pytest.raises(GuardError, match="no module named"):
        with guard(tiny, modules=["l1", "missing"]):
            pass
    with pytest.raises(GuardError, match="nothing to guard"):
        with guard(tiny, modules=lambda n, m: False):
            pass
    with pytest.raises(GuardError, match="nn.Module"):
        guard("model")  # type: ignore[arg-type]
    assert isinstance(guard(tiny, policy=GuardPolicy(max_reruns=1)), Guard)


def test_qforensics_guard_is_callable_both_ways(tiny: Tiny) -> None:
    import qforensics.guard as pkg

    assert isinstance(qforensics.guard(tiny), Guard)
    assert isinstance(pkg(tiny), Guard)
    assert isinstance(pkg.guard(tiny), Guard)
