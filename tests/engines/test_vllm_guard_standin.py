"""The vLLM guard on a stand-in runner (no vLLM needed: these run in the main suite).

The stand-in's linears follow vLLM 0.32's CPU W4A16 layer as `CPUWNA16LinearKernel` leaves it
after loading: a `LinearBase` subclass (matched by class name and module, as the guard matches
vLLM's), ``qweight`` int32 [N/16, 2K] (per block of 16 output columns, K rows of 2 words,
nibbles sequential along N), ``qzeros`` int32 [K/G, N/8] (sequential along N), ``scales``
[K/G, N], ``use_w4a8`` False, and a forward returning ``(output, None)``. The packing and the
stand-in kernel are written here from that definition; the guard reads the layer with replay's
layout adapter. One group scale of the second layer is +Inf. Expectations: the dense model with
that scale replaced by the median of its column's other scales (the documented estimate)."""

from __future__ import annotations

import json
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from qforensics.engines import vllm as adapter
from qforensics.engines import vllm_fallbacks
from qforensics.trace.reader import open_trace
from vllm_runs import sched_output

K, N, G = 32, 32, 8  # 4 groups: 3 finite scales left in the corrupted column (an odd median)
BAD_GROUP, BAD_COL = 2, 5


class LinearBase(nn.Module):
    """Stand-in for vllm.model_executor.layers.linear.LinearBase."""


LinearBase.__module__ = "vllm.model_executor.layers.linear"


def _pack_along_n(v: torch.Tensor) -> torch.Tensor:
    """[R, N] values 0..15 -> int32 [R, N/8], value 8w+i in nibble i of word w."""
    v = v.to(torch.int64).reshape(v.shape[0], -1, 8)
    words = sum(v[:, :, i] << (4 * i) for i in range(8)).numpy()
    return torch.from_numpy((words & 0xFFFFFFFF).astype(np.uint32).view(np.int32))


def _unpack_along_n(w: torch.Tensor) -> torch.Tensor:
    w = w.to(torch.int64) & 0xFFFFFFFF
    return torch.stack([(w >> (4 * i)) & 0xF for i in range(8)], -1).reshape(w.shape[0], -1)


class W4A16Method:
    """The stand-in kernel: unpack the repack, (q - z) * s, one float32 GEMM."""

    def __init__(self) -> None:
        self.quant_config = SimpleNamespace(group_size=G)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias=None) -> torch.Tensor:
        words = layer.qweight.reshape(N // 16, K, 2).permute(1, 0, 2).reshape(K, N // 8)
        q = _unpack_along_n(words).float()
        z = _unpack_along_n(layer.qzeros).float().repeat_interleave(G, 0)
        s = layer.scales.float().repeat_interleave(G, 0)
        return (x.float() @ ((q - z) * s)).to(x.dtype)


class StandInW4A16(LinearBase):
    def __init__(self, q: torch.Tensor, z: torch.Tensor, s: torch.Tensor) -> None:
        super().__init__()
        words = _pack_along_n(q)  # [K, N/8]
        self.qweight = nn.Parameter(words.reshape(K, N // 16, 2).permute(1, 0, 2)
                                    .reshape(N // 16, 2 * K).contiguous(), requires_grad=False)
        self.qzeros = nn.Parameter(_pack_along_n(z), requires_grad=False)
        self.scales = nn.Parameter(s.clone(), requires_grad=False)
        self.use_w4a8 = False
        self.input_size_per_partition = K
        self.output_partition_sizes = [N]
        self.tp_size = 1
        self.bias = None
        self.quant_method = W4A16Method()

    def forward(self, x: torch.Tensor):
        return self.quant_method.apply(self, x), None


def _parts(seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (K, N), generator=g)
    z = torch.randint(4, 12, (K // G, N), generator=g)
    s = torch.rand(K // G, N, generator=g) * 0.05 + 0.01
    return q, z, s


def _dense(q, z, s) -> torch.Tensor:
    return (q - z.repeat_interleave(G, 0)).float() * s.repeat_interleave(G, 0)  # [K, N]


class _Logits(nn.Module):
    def forward(self, head: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return h @ head.weight.t()


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, K)
        self.parts = [_parts(1), _parts(2)]
        s_bad = self.parts[1][2].clone()
        s_bad[BAD_GROUP, BAD_COL] = float("inf")
        self.layers = nn.ModuleList([StandInW4A16(*self.parts[0]),
                                     StandInW4A16(self.parts[1][0], self.parts[1][1], s_bad)])
        self.lm_head = nn.Linear(N, 50, bias=False)
        self.logits_processor = _Logits()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + layer(h)[0]
        return h

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, h)

    def expected_logits(self, ids: list[int], rows: list[int]) -> torch.Tensor:
        """The dense model, the Inf scale replaced by its column's median finite scale."""
        q, z, s = self.parts[1]
        s_est = s.clone()
        others = [s[g, BAD_COL] for g in range(K // G) if g != BAD_GROUP]
        s_est[BAD_GROUP, BAD_COL] = torch.stack(others).median()
        with torch.no_grad():
            h = self.embed(torch.tensor(ids))
            h = h + h @ _dense(*self.parts[0])
            h = h + h @ _dense(q, z, s_est)
            return h[rows] @ self.lm_head.weight.t()


def _runner_module(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)

    class StandInModelRunner:
        def __init__(self) -> None:
            self.vllm_config = SimpleNamespace(
                compilation_config=SimpleNamespace(mode=SimpleNamespace(name="NONE"),
                                                   cudagraph_mode=SimpleNamespace(name="NONE")),
                model_config=SimpleNamespace(enforce_eager=True, quantization="awq",
                                             dtype=torch.float32, model="/nowhere/awq"),
                parallel_config=SimpleNamespace(data_parallel_rank=0, data_parallel_size=1))
            self.input_batch = SimpleNamespace(req_ids=[], num_computed_tokens_cpu=np.zeros(8),
                                               num_prompt_tokens=np.zeros(8))

        def load_model(self) -> None:
            self.model = _Model()

        def get_model(self) -> nn.Module:
            return self.model

        def execute_model(self, sched):
            with torch.inference_mode():
                h = self.model(input_ids=torch.tensor(sched.ids),
                               positions=torch.tensor(sched.positions))
                self.logits = self.model.compute_logits(h[sched.logits_rows])
            return None

        def dummy_run(self, n: int) -> None:
            with torch.inference_mode():
                self.model(input_ids=torch.zeros(n, dtype=torch.long), positions=torch.arange(n))

    StandInModelRunner.__module__ = name
    mod.StandInModelRunner = StandInModelRunner
    return mod


def _serve(tmp_path, monkeypatch, adapter_mod, name, guard: bool, mode: str = "NONE"):
    monkeypatch.setenv("QFORENSICS_TRACE", str(tmp_path / f"{name}.h5"))
    monkeypatch.setenv("QFORENSICS_OPTIONS", "{}")
    if guard:
        monkeypatch.setenv("QFORENSICS_GUARD", json.dumps({"check": "logits"}))
    else:
        monkeypatch.delenv("QFORENSICS_GUARD", raising=False)
    mod = _runner_module(name)
    adapter_mod.patch_runner_module(mod)
    r = mod.StandInModelRunner()
    r.vllm_config.compilation_config.mode = SimpleNamespace(name=mode)
    r.load_model()
    cap = adapter_mod._captures[id(r)]
    out = []
    try:
        r.dummy_run(4)  # warm-up: never checked
        ib = r.input_batch
        ib.req_ids = ["A", "B"]  # step 1: prefill of A (3 tokens) and B (2)
        ib.num_computed_tokens_cpu[:2] = [0, 0]
        ib.num_prompt_tokens[:2] = [3, 2]
        r.execute_model(sched_output(["A", "B"], [3, 2], [5, 6, 7, 8, 9], [0, 1, 2, 0, 1], [2, 4]))
        out.append(r.logits.clone())
        ib.req_ids = ["B", "A", "C"]  # step 2: decodes of B and A, prefill of C (2)
        ib.num_computed_tokens_cpu[:3] = [2, 3, 0]
        ib.num_prompt_tokens[:3] = [2, 3, 2]
        r.execute_model(sched_output(["B", "A", "C"], [1, 1, 2], [11, 12, 13, 14], [2, 3, 0, 1],
                               [0, 1, 3]))
        out.append(r.logits.clone())
    finally:
        cap.close()
    with open_trace(tmp_path / f"{name}.h5") as t:
        inc = list(t.incidents.itertuples(index=False))
        env = t.meta["environment"]
    return r, out, inc, env


def test_without_the_guard_the_logits_are_nonfinite(tmp_path, monkeypatch, fresh_adapter):
    _r, out, inc, env = _serve(tmp_path, monkeypatch, fresh_adapter, "plain_runner", False)
    assert not bool(torch.isfinite(out[0]).all()) and not bool(torch.isfinite(out[1]).all())
    assert inc == []
    assert env["model_path"] == "/nowhere/awq"  # vLLM's model= argument, as given


def test_the_guard_repairs_the_layer_and_names_each_request_once(tmp_path, monkeypatch,
                                                                  fresh_adapter, capsys):
    r, out, inc, _env = _serve(tmp_path, monkeypatch, fresh_adapter, "guarded_runner", True)
    err = capsys.readouterr().err
    assert "vLLM guard on 2 layers (2 x vLLM CPU W4A16 repack" in err
    torch.testing.assert_close(out[0], r.model.expected_logits([5, 6, 7, 8, 9], [2, 4]),
                               rtol=1e-4, atol=1e-4)
    # step 2: the layer is suspect; its non-finite column comes from the fallback
    torch.testing.assert_close(out[1], r.model.expected_logits([11, 12, 13, 14], [0, 1, 3]),
                               rtol=1e-4, atol=1e-4)
    acts = [(i.step, i.module, i.action) for i in inc]
    assert (1, "layers.1", "fallback") in acts and (1, "layers.1", "dequantized") in acts
    assert not any(m == "layers.0" for _s, m, _a in acts)
    deq = next(i for i in inc if i.action == "dequantized")
    assert "vllm-cpu-w4a16 layout" in deq.detail and "1 NaN/Inf group scale" in deq.detail
    named = [(i.step, i.detail.split(":")[0]) for i in inc if i.action == "request_repaired"]
    assert named == [(1, "request A"), (1, "request B"), (2, "request C")]
    c = next(i for i in inc if i.detail.startswith("request C"))
    assert "in the output of layers.1" in c.detail and c.nan_count + c.inf_count > 0
    assert not any(a in ("request_sanitized", "guard_off") for _s, _m, a in acts)
    assert int(torch.isinf(r.model.layers[1].scales).sum()) == 1  # vLLM's tensors untouched


def test_in_compiled_mode_the_guard_checks_and_sanitizes_the_logits_only(
        tmp_path, monkeypatch, fresh_adapter, capsys):
    """vLLM compiles the model: no layer hook added after the compile would run and no rerun
    would reach a swapped layer, so the guard says so, checks each request's logits and
    sanitizes them; the engine's outputs are finite and no layer fallback is claimed."""
    r, out, inc, _env = _serve(tmp_path, monkeypatch, fresh_adapter, "compiled_guarded", True,
                               mode="VLLM_COMPILE")
    err = capsys.readouterr().err
    assert "vLLM guard in compiled mode: per-request logits check and sanitizing only" in err
    assert all(bool(torch.isfinite(o).all()) for o in out)
    acts = {i.action for i in inc}
    assert "request_sanitized" in acts
    assert not acts & {"fallback", "dequantized", "request_repaired"}


def test_a_guard_failure_turns_it_off_and_the_engine_goes_on(tmp_path, monkeypatch,
                                                             fresh_adapter, capsys):
    def broken(self):
        raise RuntimeError("cannot read the layer")

    monkeypatch.setattr(vllm_fallbacks.VllmCpuW4A16, "dequantize", broken)
    _r, out, inc, _env = _serve(tmp_path, monkeypatch, fresh_adapter, "broken_runner", True)
    err = capsys.readouterr().err
    assert err.count("vLLM guard off after an internal error") == 1
    assert "cannot read the layer" in err
    offs = [i for i in inc if i.action == "guard_off"]
    assert len(offs) == 1 and "cannot read the layer" in offs[0].detail
    assert len(out) == 2  # both steps ran; unguarded from the failure on
    assert not bool(torch.isfinite(out[1]).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_identity_probe_reads_a_blocked_kernel_and_reestimates_a_bad_scale(dtype):
    """`VllmMethodProbe` on a kernel that sums scaled group partials (as W4A8 does): one Inf
    scale makes the whole column non-finite through the kernel; the probe recovers every other
    weight exactly and the bad group with its column's median scale; the layer is untouched."""

    class GroupSumMethod:
        quant_config = SimpleNamespace(group_size=G)

        def apply(self, layer, x, bias=None):
            xg = x.float().reshape(x.shape[0], K // G, G)
            qi = (layer.q.reshape(K // G, G, N) - layer.z[:, None, :]).float()
            part = torch.einsum("mgk,gkn->mgn", xg, qi)
            return (part * layer.scales.float()[None]).sum(1).to(x.dtype)

    class Blocked(LinearBase):
        def __init__(self, q, z, s):
            super().__init__()
            self.register_buffer("q", q)
            self.register_buffer("z", z)
            self.scales = nn.Parameter(s.to(dtype), requires_grad=False)
            self.quant_method = GroupSumMethod()
            self.input_size_per_partition = K
            self.output_partition_sizes = [N]
            self.params_dtype = torch.float32

    q, z, s = _parts(3)
    s = s.to(dtype).float()
    bad = s.clone()
    bad[BAD_GROUP, BAD_COL] = float("inf")
    layer = Blocked(q, z, bad)
    assert vllm_fallbacks.VllmMethodProbe.can_take(layer) == (True, "")
    assert not vllm_fallbacks.VllmCpuW4A16.can_take(layer)[0]
    fb = vllm_fallbacks.VllmMethodProbe(layer, None)
    w = fb.dense_weight(torch.float32).t()  # [K, N]
    assert torch.isinf(layer.scales).sum() == 1  # put back
    s_est = s.clone()
    s_est[BAD_GROUP, BAD_COL] = torch.stack([s[g, BAD_COL] for g in range(K // G)
                                             if g != BAD_GROUP]).median()
    torch.testing.assert_close(w, _dense(q, z, s_est), rtol=1e-2, atol=1e-3)
    assert (fb.imputed, fb.params_zeroed, fb.zeroed) == (1, 1, 0)


def _sharded(kind: str, **attrs) -> nn.Module:
    """A stand-in W4A16 layer whose class derives from a stand-in of vLLM's `kind` class."""
    parent = type(kind, (LinearBase,), {})
    parent.__module__ = "vllm.model_executor.layers.linear"
    layer = StandInW4A16(*_parts(3))
    layer.__class__ = type(f"Sharded{kind}", (parent, StandInW4A16), {})
    layer.tp_size = 3
    for k, v in attrs.items():
        setattr(layer, k, v)
    return layer


@pytest.mark.parametrize("kind, attrs, local", [
    ("ColumnParallelLinear", {"gather_output": False}, True),  # qkv_proj, gate_up_proj
    ("ColumnParallelLinear", {"gather_output": True}, False),  # gathers: a collective inside
    ("RowParallelLinear", {"reduce_results": True}, False),  # o_proj, down_proj
    ("RowParallelLinear", {"reduce_results": False}, True),  # its caller all-reduces
])
def test_a_sharded_layer_falls_back_only_when_its_output_is_local(kind, attrs, local):
    layer = _sharded(kind, **attrs)
    assert vllm_fallbacks.local_output(layer) is local
    ok, why = vllm_fallbacks.VllmCpuW4A16.can_take(layer)
    assert ok is local
    if not local:
        assert "sharded over 3 tensor-parallel ranks" in why
    else:  # this rank's shard, as its kernel computes it
        fb = vllm_fallbacks.VllmCpuW4A16(layer, None)
        x = torch.randn(4, K)
        torch.testing.assert_close(fb(x, torch.float32), layer(x)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tp, reruns", [(1, 2), (3, 1)])
def test_under_tensor_parallelism_a_failing_step_is_rerun_once(tp, reruns):
    """Each rank decides alone how often to rerun (a second rerun follows its own trips); a
    rank rerunning alone would wait forever in the collectives, so TP caps reruns at one."""
    from qforensics.engines.vllm_guard import VllmGuard
    from qforensics.guard.policy import resolve_policy

    model = nn.Sequential(_sharded("ColumnParallelLinear", gather_output=False))
    model[0].tp_size = tp
    g = VllmGuard(model, resolve_policy({"modules": vllm_fallbacks.is_vllm_linear}),
                  SimpleNamespace())
    assert g.policy.max_reruns == 2  # the default
    g.attach()
    try:
        assert g.policy.max_reruns == reruns
    finally:
        g.close()


def test_a_row_parallel_shard_is_guarded_before_the_all_reduce():
    """Under TP a row-parallel layer's method is fronted by the guard's stand-in, which hands
    each partial output to the guard before vLLM's reduce; the identity probe of its fallback
    runs the layer's own method, never the stand-in; closing puts the method back."""
    from qforensics.engines import vllm_tp
    from qforensics.engines.vllm_guard import VllmGuard
    from qforensics.guard.policy import resolve_policy

    layer = _sharded("RowParallelLinear", reduce_results=True, params_dtype=torch.float32)
    own = layer.quant_method
    assert vllm_tp.needs_pre_reduce(layer)
    assert not vllm_fallbacks.VllmCpuW4A16.can_take(layer)[0]
    assert vllm_fallbacks.VllmCpuW4A16.can_take(layer, pre_reduce=True)[0]
    g = VllmGuard(nn.Sequential(layer), resolve_policy({"modules": vllm_fallbacks.is_vllm_linear}),
                  SimpleNamespace())
    g.attach()
    try:
        assert isinstance(layer.quant_method, vllm_tp.PreReduceMethod)
        assert layer.quant_method.inner is own and g.guarded[0][1].pre_reduce
        seen = []
        # what the stand-in calls after the method: the guard's hook, replaced by a probe
        layer.quant_method.on_partial = lambda i, mod, x, out: seen.append(i) or out
        x = torch.randn(3, K)
        y = layer(x)[0]
        assert seen == [0]
        probe = vllm_fallbacks.VllmMethodProbe(layer, None)
        w = probe.dense_weight(torch.float32)  # [N, K], through the layer's own method
        assert seen == [0]
        torch.testing.assert_close(x @ w.t(), y, rtol=1e-4, atol=1e-4)
    finally:
        g.close()
    assert layer.quant_method is own
