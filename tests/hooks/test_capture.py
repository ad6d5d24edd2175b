"""Capture promises on small models: identical outputs, hooks removed, odd tensors, snapshots,
degradation instead of crashes."""

from __future__ import annotations

import json

import logging

import numpy as np
import pytest
import torch
from torch import nn

import qforensics
from qforensics.errors import CaptureError
from qforensics.hooks.capture import active_capture
from qforensics.trace import schema

from capture_models import Tiny, ids


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_outputs_bit_identical_and_stats_match(tmp_path):
    m = Tiny()
    x = ids(5)
    with torch.no_grad():
        ref = m(x)
        with qforensics.capture(m, tmp_path / "t.h5"):
            got = m(x)
    assert torch.equal(ref, got)
    with qforensics.open_trace(tmp_path / "t.h5") as t:
        assert t.n_steps == 1
        assert t.end.complete
        recs = t.records(0)
        # head output = logits: recorded stats equal the real tensor's
        head = recs[(recs.module == "head") & (recs.io == 1)].iloc[0]
        assert head["max"] == pytest.approx(float(ref.detach().max()), rel=1e-6)
        assert head["min"] == pytest.approx(float(ref.min()), rel=1e-6)
        assert head["absmax"] == pytest.approx(float(ref.abs().max()), rel=1e-6)
        assert head["mean"] == pytest.approx(float(ref.mean()), rel=1e-5, abs=1e-6)
        assert head["std"] == pytest.approx(float(ref.std(unbiased=False)), rel=1e-5)
        cmin, cmax = t.channel_ranges(int(head["row"]))
        np.testing.assert_allclose(cmin, ref[0].min(0).values.detach().numpy(), rtol=1e-6)
        np.testing.assert_allclose(cmax, ref[0].max(0).values.detach().numpy(), rtol=1e-6)
        tok = t.token_absmax(int(head["row"]))
        np.testing.assert_allclose(tok, ref[0].abs().max(1).values.detach().numpy(), rtol=1e-6)
        s = t.steps.iloc[0]
        assert s["logits_argmax"] == int(ref[0, -1].argmax())
        assert list(s["logits_top5_ids"]) == ref[0, -1].topk(5).indices.tolist()
        assert list(t.input_ids(0)) == x[0].tolist()
        # call order: up, down, block for each layer, then head, then the model output
        names = recs.drop_duplicates("call_index")["module"].tolist()
        assert names[:3] == ["layers.0.up", "layers.0.down", "layers.0"]
        assert names[-2:] == ["head", ""]


def test_hooks_removed_on_exit_exception_and_nested(tmp_path):
    m = Tiny()
    before = _hook_count(m)
    with qforensics.capture(m, tmp_path / "a.h5") as cap:
        assert cap.hooks_attached > 0
        assert active_capture(m) is cap
    assert _hook_count(m) == before
    assert active_capture(m) is None

    with pytest.raises(RuntimeError, match="boom"):
        with qforensics.capture(m, tmp_path / "b.h5"):
            raise RuntimeError("boom")
    assert _hook_count(m) == before

    other = Tiny()
    with qforensics.capture(m, tmp_path / "c.h5"):
        with qforensics.capture(other, tmp_path / "d.h5"):
            m(ids())
            other(ids())
        assert _hook_count(other) == 0
    assert _hook_count(m) == before
    with qforensics.open_trace(tmp_path / "b.h5") as t:
        assert t.meta["status"]["state"] == "error"
        assert "boom" in t.meta["status"]["error"]


def test_attaching_twice_is_refused(tmp_path):
    m = Tiny()
    with qforensics.capture(m, tmp_path / "a.h5"):
        with pytest.raises(CaptureError, match="already attached"):
            qforensics.capture(m, tmp_path / "b.h5").attach()
    assert _hook_count(m) == 0
    # nothing is written onto the user's modules
    assert not any(k.startswith("_qf") or "qforensics" in k
                   for mod in m.modules() for k in vars(mod))


def test_nothing_to_hook_is_a_clear_error(tmp_path):
    with pytest.raises(CaptureError, match="nothing to hook"):
        qforensics.capture(nn.ReLU(), tmp_path / "a.h5").attach()


def test_exception_in_forward_flushes_what_came_before(tmp_path):
    class Exploding(Tiny):
        def forward(self, input_ids):
            x = self.emb(input_ids)
            x = self.layers[0](x)
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    m = Exploding()
    with pytest.raises(RuntimeError, match="illegal memory access"):
        with qforensics.capture(m, tmp_path / "t.h5"):
            m(ids())
    with qforensics.open_trace(tmp_path / "t.h5") as t:
        assert t.n_steps == 1
        s = t.steps.iloc[0]
        assert s["complete"] == 0
        recs = t.records(0)
        assert set(recs.module) >= {"layers.0.up", "layers.0.down", "layers.0"}
        assert "illegal memory access" in t.end.reason


def test_a_seal_mid_forward_marks_that_step_cut_short_and_the_run_passes(tmp_path):
    """SIGTERM's seal while a forward runs (a server stopped mid-step): the run's end is
    complete, the step it cut says complete 0, and the healthy run reads PASSED."""
    from qforensics.analyze import PASSED, analyze_trace

    class Stopped(Tiny):
        calls = 0

        def forward(self, input_ids):
            x = self.emb(input_ids)
            Stopped.calls += 1
            if Stopped.calls == 3:  # the third step: sealed before any layer ran
                active_capture(self).close({"state": "complete", "signal": "SIGTERM"})
                return None
            return super().forward(input_ids)

    m = Stopped()
    with qforensics.capture(m, tmp_path / "t.h5"):
        for _ in range(3):
            m(ids())
    with qforensics.open_trace(tmp_path / "t.h5") as t:
        assert t.n_steps == 3 and t.end.complete
        assert t.steps["complete"].tolist() == [1, 1, 0]
        assert t.steps["record_count"].iloc[2] == 0
    f = analyze_trace(tmp_path / "t.h5")
    assert f.status == PASSED, f.verdict.line


class Odd(nn.Module):
    """Tuple, dict, integer, None outputs and a module called twice per step."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.layers = nn.ModuleList([TupleBlock(), TupleBlock()])

    def forward(self, x):
        y = self.lin(x)
        y = self.lin(y)  # called twice in one step
        for layer in self.layers:
            y, aux = layer(y)
        return {"logits": y, "count": torch.tensor([3, 4]), "nothing": None}


class TupleBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x), torch.arange(3)


def test_tuple_dict_integer_and_repeated_calls(tmp_path):
    m = Odd()
    x = torch.randn(2, 3, 4)
    ref = m(x)["logits"]
    with qforensics.capture(m, tmp_path / "t.h5"):
        out = m(x)
        m(x)
    assert torch.equal(out["logits"], ref)
    with qforensics.open_trace(tmp_path / "t.h5") as t:
        assert t.n_steps == 2
        recs = t.records(0)
        lin = recs[(recs.module == "lin") & (recs.io == 0)]
        assert len(lin) == 2 and lin.call_index.nunique() == 2
        assert int(lin.iloc[0]["rows"]) == 6 and int(lin.iloc[0]["channels"]) == 4
        block_out = recs[(recs.module == "layers.0") & (recs.io == 1)]
        assert len(block_out) == 1  # first tensor of the tuple only
        root = recs[recs.module == ""]
        assert len(root) == 1 and root.iloc[0]["max"] == pytest.approx(float(ref.detach().max()), rel=1e-6)


def test_meta_and_integer_tensors_do_not_crash(tmp_path):
    class IntOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x).argmax(-1)  # integer model output

    m = IntOut()
    with qforensics.capture(m, tmp_path / "t.h5") as cap:
        out = m(torch.randn(3, 4))
    assert cap.degraded is None
    with qforensics.open_trace(tmp_path / "t.h5") as t:
        root = t.records(0).query("module == ''").iloc[0]
        assert root["flags"] & schema.FLAG_NONFLOAT
        assert root["max"] == float(out.max())
        assert t.steps.iloc[0]["has_logits"] == 0

    meta_model = Tiny().to("meta")
    with qforensics.capture(meta_model, tmp_path / "m.h5") as cap:
        meta_model(ids().to("meta"))
    assert cap.degraded is None
    with qforensics.open_trace(tmp_path / "m.h5") as t:
        recs = t.records(0)
        assert (recs["flags"] & schema.FLAG_META).all()


def test_nan_is_counted_and_snapshotted(tmp_path):
    m = Tiny()
    with torch.no_grad():
        m.layers[1].up.weight[3, 0] = float("nan")
        m.layers[1].up.weight[5, 1] = float("inf")
    x = ids(4)
    with qforensics.capture(m, tmp_path / "t.h5", outlier_threshold=1e9):
        out = m(x)
    with qforensics.open_trace(tmp_path / "t.h5") as t:
        s = t.steps.iloc[0]
        recs = t.records(0)
        first = recs[recs.row == s["first_nonfinite_record"]].iloc[0]
        assert first["module"] == "layers.1.up" and first["io"] == 1
        assert s["first_nonfinite_call"] == first["call_index"]
        up_in = recs[(recs.module == "layers.1.up") & (recs.io == 0)].iloc[0]
        assert up_in["nan_count"] == 0 and up_in["inf_count"] == 0
        # exact counts on the output; finite-only stats stay finite
        up_out = m.layers[1].up(m.layers[0](m.emb(x))).detach()
        assert first["nan_count"] == int(torch.isnan(up_out).sum())
        assert first["inf_count"] == int(torch.isinf(up_out).sum())
        fin = up_out[torch.isfinite(up_out)]
        assert first["max"] == pytest.approx(float(fin.max()), rel=1e-6)
        assert bool(torch.isnan(out).any()) and t.steps.iloc[0]["logits_nan"] > 0
        snaps = t.snapshots
        assert set(snaps.reason) == {"first_nonfinite_output"}
        kept = t.snapshot_tensors(int(first["call_index"]))
        assert set(kept) >= {"input.0", "output.0", "weight", "bias", "call.json",
                             "nonfinite_positions"}
        np.testing.assert_array_equal(kept["weight"], m.layers[1].up.weight.detach().numpy())
        facts = json.loads(kept["call.json"].tobytes())  # the layer is small: kept whole
        assert facts["kept"] == "whole" and facts["module_type"] == type(m.layers[1].up).__name__
        assert facts["params"]["weight"]["shape"] == list(m.layers[1].up.weight.shape)
        assert facts["input_dtype"] == "float32" and facts["library"] == "torch"
        pos = kept["nonfinite_positions"]  # the op path keeps [rows, channels]
        assert pos.shape[1] == kept["output.0"].ndim == 2
        assert not np.isfinite(kept["output.0"][tuple(pos[0])])


def test_internal_error_degrades_without_crashing(tmp_path, monkeypatch, caplog):
    import qforensics.hooks.graphhooks as graphhooks  # the eager hooks' op calls

    def broken(*a, **k):
        raise ValueError("odd tensor")

    monkeypatch.setattr(graphhooks, "_call_plan", broken)
    m = Tiny()
    ref = m(ids())
    with caplog.at_level(logging.ERROR):
        with qforensics.capture(m, tmp_path / "t.h5") as cap:
            got = m(ids())
            m(ids())
    assert torch.equal(ref, got)
    assert "odd tensor" in cap.degraded
    assert sum("capture error" in r.message for r in caplog.records) == 1  # logged once
    with qforensics.open_trace(tmp_path / "t.h5") as t:
        assert "odd tensor" in t.meta["status"]["capture_error"]


def test_disk_errors_degrade_without_crashing(tmp_path, monkeypatch):
    from qforensics.trace.writer import TraceWriter

    def full(self, b):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(TraceWriter, "_append_batch", full)
    m = Tiny()
    with qforensics.capture(m, tmp_path / "t.h5", flush_interval=0.05) as cap:
        for _ in range(3):
            m(ids())
    assert "No space left" in cap.degraded
    with qforensics.open_trace(tmp_path / "t.h5") as t:
        assert "No space left" in t.meta["status"]["writer_error"]


def test_rank_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    m = Tiny()
    with qforensics.capture(m, tmp_path / "trace.h5") as cap:
        m(ids())
    assert cap.path.endswith("trace-3.h5")
    with qforensics.open_trace(cap.path) as t:
        env = t.meta["environment"]
        assert env["rank"] == 3 and env["world_size"] == 4
    with qforensics.capture(Tiny(), str(tmp_path / "r{rank}.h5")) as cap:
        pass
    assert cap.path.endswith("r3.h5")


def test_channel_options_and_float16_keeps_large_values_finite(tmp_path):
    m = Tiny()
    with torch.no_grad():
        m.layers[0].down.bias[2] = 1e5  # above float16's 65504, still finite
    with qforensics.capture(m, tmp_path / "t.h5", channel_dtype="float16", channel_steps="1",
                            channel_io="inputs") as cap:
        for _ in range(3):
            m(ids())
    with qforensics.open_trace(tmp_path / "t.h5") as t:
        assert (t.records(0).chan_offset == -1).all()
        r1 = t.records(1)
        assert (r1[r1.io == 1].chan_offset == -1).all()
        blk = r1[(r1.module == "layers.1.up") & (r1.io == 0)].iloc[0]
        cmin, cmax = t.channel_ranges(int(blk["row"]))
        assert np.isfinite(cmax).all() and cmax.max() == np.float32(65504)
        assert blk["nan_count"] == 0 and blk["inf_count"] == 0
    assert cap.options["channel_dtype"] == "float16"


def test_modules_option(tmp_path):
    m = Tiny()
    with qforensics.capture(m, tmp_path / "t.h5", modules="linear"):
        m(ids())
    with qforensics.open_trace(tmp_path / "t.h5") as t:
        assert set(t.modules.kind) == {"linear", "root"}
    with qforensics.capture(m, tmp_path / "u.h5", modules=["layers.2.down"]):
        m(ids())
    with qforensics.open_trace(tmp_path / "u.h5") as t:
        assert t.modules.name.tolist() == ["layers.2.down", ""]


class WQLinear_GEMM(nn.Module):  # noqa: N801 - AutoAWQ's class name, recognised by name
    """An AWQ-layout INT4 linear (qweight [K, N/8], qzeros [K/G, N/8], scales [K/G, N])."""

    def __init__(self, k: int = 16, n: int = 16, group: int = 8):
        super().__init__()
        self.w_bit, self.group_size = 4, group
        g = torch.Generator().manual_seed(0)
        self.register_buffer("qweight", torch.randint(0, 2**31 - 1, (k, n // 8), generator=g,
                                                      dtype=torch.int32))
        self.register_buffer("qzeros", torch.full((k // group, n // 8), 0x88888888 - 2**32,
                                                  dtype=torch.int32))
        self.register_buffer("scales", torch.full((k // group, n), 0.01, dtype=torch.float16))
        self.scales[1, 3] = float("nan")
        self.n = n

    def forward(self, x):
        return x.new_full((*x.shape[:-1], self.n), float("nan"))


def test_awq_module_is_recognised_and_snapshotted_packed(tmp_path):
    model = nn.Sequential(nn.Linear(16, 16), WQLinear_GEMM())
    with qforensics.capture(model, tmp_path / "t.h5"):
        model(torch.randn(2, 16))
    with qforensics.open_trace(tmp_path / "t.h5") as t:
        mods = t.modules.set_index("name")
        assert mods.loc["1", "kind"] == "quantized_linear"
        info = t.module_info(int(np.nonzero(t.modules.name.to_numpy() == "1")[0][0]))
        assert info["quant"] == {"bits": 4, "format": "awq-gemm", "group_size": 8}
        assert info["layout"] == "awq-gemm"  # the detector's name, in both places
        assert info["health"]["scales"]["nan"] == 1
        kept = t.snapshot_tensors(1)
        assert kept["qweight"].dtype == np.int32 and kept["qweight"].shape == (16, 2)
        assert kept["scales"].dtype == np.float16 and kept["scales"].shape == (2, 16)
        assert "weight_cols" not in kept  # small enough to keep whole: no tile span
        assert json.loads(kept["call.json"].tobytes())["kept"] == "whole"


def test_ring_chunks_are_sized_from_the_layers_widths():
    """vLLM's CPU linears keep an empty weight once repacked and say their sizes as
    input_size / output_size; nn.Linear as in_features / out_features; a packed weight's shape
    is no width. A slot of ~4 chunks either way (the layers' widths over 4, a power of two)."""
    from qforensics.hooks.modules import io_width, ring_chunk

    class Repacked(nn.Module):  # vLLM's QKVParallelLinear after oneDNN repacking
        def __init__(self, i: int, o: int) -> None:
            super().__init__()
            self.input_size, self.output_size = i, o
            self.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    class Packed(nn.Module):  # int4 weights packed 8 per int32 (AWQ-like): shape is not width
        def __init__(self, i: int, o: int) -> None:
            super().__init__()
            self.in_features, self.out_features = i, o
            self.register_buffer("weight", torch.zeros(i, o // 8, dtype=torch.int32))

    assert io_width(Repacked(576, 960)) == 1536
    assert io_width(nn.Linear(576, 1536)) == 2112
    assert io_width(Packed(576, 1536)) == 2112
    assert io_width(nn.ReLU()) == 0
    vllm_like = [Repacked(576, 960), Repacked(576, 576), Repacked(576, 3072),
                 Repacked(1536, 576)] * 30  # SmolLM2's 30 layers: 253,440 channels
    assert ring_chunk(vllm_like) == 65536  # 253,440 / 4 = 63,360 -> the next power of two
    assert ring_chunk([nn.Linear(64, 64)] * 4) == 4096  # the floor
    assert ring_chunk([nn.Linear(576, 576)] * 20) == 8192  # 23,040 / 4 = 5,760 -> 8,192


@pytest.mark.parametrize("channel_steps", ["auto", "all"])  # lazy ranges / copied at once
def test_a_channel_without_a_finite_value_reads_nan(tmp_path, channel_steps):
    """A weight row turned NaN makes one output channel NaN at every token: the trace's
    format gives NaN for a channel with no finite value (the op leaves +inf / -inf in its
    ring), and finite ranges for the others."""
    m = Tiny()
    with torch.no_grad():
        m.layers[1].up.weight[3, :] = float("nan")
    with qforensics.capture(m, tmp_path / "t.h5", channel_steps=channel_steps):
        m(ids(4))
    with qforensics.open_trace(tmp_path / "t.h5") as t:
        got = t.channels_for("layers.1.up", 0, io=1)
        assert got is not None
        lo, hi = got
        assert np.isnan(lo[3]) and np.isnan(hi[3])
        assert np.isfinite(np.delete(lo, 3)).all() and np.isfinite(np.delete(hi, 3)).all()
