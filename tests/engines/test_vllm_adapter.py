"""The vLLM adapter's wrapping and mapping logic on a stand-in runner module (no vLLM needed:
these run in the main suite). The stand-in follows the shape of vLLM 0.32's model runner: a
`*ModelRunner` class with load_model / execute_model(scheduler_output) / sample_tokens, an
input batch with req_ids, num_computed_tokens_cpu and num_prompt_tokens, and a model whose
forward returns hidden states and whose `logits_processor` returns the logits. The real engine
is covered by the `vllm`-marked tests."""

from __future__ import annotations

import types
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import torch
from torch import nn

from qforensics.engines import vllm as adapter
from qforensics.trace.reader import open_trace
from vllm_runs import sched_output


class _Logits(nn.Module):
    def forward(self, head: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return h @ head.weight.t()


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, 16)
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
        self.lm_head = nn.Linear(16, 50, bias=False)
        self.logits_processor = _Logits()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        return h

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, h)


def _runner_module(name: str = "fake_model_runner") -> types.ModuleType:
    mod = types.ModuleType(name)

    class FakeModelRunner:
        def __init__(self) -> None:
            self.vllm_config = SimpleNamespace(
                compilation_config=SimpleNamespace(mode=SimpleNamespace(name="NONE"),
                                                   cudagraph_mode=SimpleNamespace(name="NONE")),
                model_config=SimpleNamespace(enforce_eager=True, quantization=None,
                                             dtype="float32"),
                parallel_config=SimpleNamespace(data_parallel_rank=0, data_parallel_size=1))
            self.input_batch = SimpleNamespace(req_ids=[], num_computed_tokens_cpu=np.zeros(8),
                                               num_prompt_tokens=np.zeros(8))
            self.last = None

        def load_model(self) -> None:
            self.model = _Model()

        def get_model(self) -> nn.Module:
            return self.model

        def execute_model(self, sched):
            ids = torch.tensor(sched.ids)
            with torch.inference_mode():
                h = self.model(input_ids=ids, positions=torch.tensor(sched.positions))
                logits = self.model.compute_logits(h[sched.logits_rows])
            self.last = (sched, logits)
            return None

        def sample_tokens(self, grammar=None):
            sched, logits = self.last
            toks = logits.argmax(-1).tolist()
            return SimpleNamespace(req_ids=list(sched.num_scheduled_tokens),
                                   sampled_token_ids=[[t] for t in toks])

        def dummy_run(self, n: int) -> None:  # warm-up: a forward outside execute_model
            with torch.inference_mode():
                self.model(input_ids=torch.zeros(n, dtype=torch.long),
                           positions=torch.arange(n))

    FakeModelRunner.__module__ = name
    mod.FakeModelRunner = FakeModelRunner
    return mod


def test_runner_is_wrapped_and_rows_map_to_requests(tmp_path, monkeypatch, fresh_adapter):
    monkeypatch.setenv("QFORENSICS_TRACE", str(tmp_path / "t-{rank}.h5"))
    monkeypatch.setenv("QFORENSICS_OPTIONS", "{}")
    mod = _runner_module()
    assert fresh_adapter.patch_runner_module(mod) == ["fake_model_runner.FakeModelRunner"]
    assert fresh_adapter.owns_process()
    r = mod.FakeModelRunner()
    r.load_model()
    cap = fresh_adapter._captures[id(r)]
    try:
        r.dummy_run(4)  # warm-up
        ib = r.input_batch
        # step 1: prefill of A (3 tokens) and B (2 tokens)
        ib.req_ids = ["A", "B"]
        ib.num_computed_tokens_cpu[:2] = [0, 0]
        ib.num_prompt_tokens[:2] = [3, 2]
        r.execute_model(sched_output(["A", "B"], [3, 2], [5, 6, 7, 8, 9], [0, 1, 2, 0, 1], [2, 4]))
        out1 = r.sample_tokens()
        # step 2: decode of B, then A (batch order changed)
        ib.req_ids = ["B", "A"]
        ib.num_computed_tokens_cpu[:2] = [2, 3]
        ib.num_prompt_tokens[:2] = [2, 3]
        r.execute_model(sched_output(["B", "A"], [1, 1], [11, 12], [2, 3], [0, 1]))
        out2 = r.sample_tokens()
    finally:
        cap.close()
    with open_trace(tmp_path / "t-0.h5") as t:
        steps = t.engine_table("steps")
        rows = t.engine_table("rows")
        reqs = t.engine_table("requests")
        sampled = t.engine_table("sampled")
        assert t.n_steps == 3
        root = len(t.modules) - 1
        logit_rec = t.records(1).query(f"module_id == {root} and io == 1 and slot == 0")
    assert steps["warmup"].tolist() == [1, 0, 0] and steps["n_rows"].tolist() == [4, 5, 2]
    assert reqs["request_id"].tolist() == ["A", "B"]
    assert reqs["prompt_tokens"].tolist() == [3, 2]
    idx = dict(zip(reqs["request_id"], reqs["request"]))
    s1 = rows[rows["step"] == 1]
    assert s1["request"].tolist() == [idx["A"]] * 3 + [idx["B"]] * 2
    assert s1["position"].tolist() == [0, 1, 2, 0, 1] and (s1["phase"] == 0).all()
    s2 = rows[rows["step"] == 2]
    assert s2["request"].tolist() == [idx["B"], idx["A"]]
    assert s2["position"].tolist() == [2, 3] and (s2["phase"] == 1).all()
    got = {(int(s), int(q)): int(k) for s, q, k in sampled[["step", "request", "token"]].values}
    want = {(1, idx[rid]): tok[0] for rid, tok in zip(out1.req_ids, out1.sampled_token_ids)}
    want.update({(2, idx[rid]): tok[0] for rid, tok in zip(out2.req_ids, out2.sampled_token_ids)})
    assert got == want
    assert logit_rec["rows"].tolist() == [2] and logit_rec["channels"].tolist() == [50]


def test_unknown_runner_is_reported_and_generic_hooks_stay(capsys, fresh_adapter):
    mod = types.ModuleType("odd_model_runner")

    class OddModelRunner:  # no load_model: not a runner this adapter knows
        def run(self) -> None: ...

    OddModelRunner.__module__ = "odd_model_runner"
    mod.OddModelRunner = OddModelRunner
    assert fresh_adapter.patch_runner_module(mod) == []
    assert not fresh_adapter.owns_process()
    err = capsys.readouterr().err
    assert "vLLM: not mapped: OddModelRunner has no load_model" in err
    assert "generic hooks stay in charge" in err


def test_a_capture_failure_never_breaks_the_engine(tmp_path, monkeypatch, fresh_adapter):
    r, cap = _loaded(tmp_path, monkeypatch, fresh_adapter, "broken_model_runner")
    r.input_batch = None  # the mapping cannot read the batch: capture must degrade, not raise
    r.execute_model(sched_output(["A"], [2], [1, 2], [0, 1], [1]))
    out = r.sample_tokens()
    assert out.req_ids == ["A"] and len(out.sampled_token_ids) == 1  # the engine's own result
    cap.close()
    with open_trace(tmp_path / "t.h5") as t:
        assert "capture_error" in t.meta["status"]
        assert "AttributeError" in t.meta["status"]["capture_error"]



def _loaded(tmp_path, monkeypatch, adapter_mod, name: str, trace: str = "t.h5",
            options: str | None = None):
    """A fake runner module `name`, patched, its model loaded (capture attaches into
    `trace` with `options`): (runner, its capture)."""
    monkeypatch.setenv("QFORENSICS_TRACE", str(tmp_path / trace))
    if options is not None:
        monkeypatch.setenv("QFORENSICS_OPTIONS", options)
    mod = _runner_module(name)
    adapter_mod.patch_runner_module(mod)
    r = mod.FakeModelRunner()
    r.load_model()
    return r, adapter_mod._captures[id(r)]


def _ring_runner(tmp_path, monkeypatch, fresh_adapter, name: str):
    """`_loaded` with a 16-step ring and an 8-step trigger window, into t-{rank}.h5."""
    return _loaded(tmp_path, monkeypatch, fresh_adapter, name, "t-{rank}.h5",
                   '{"ring_steps": 16, "trigger_window": 8}')


def test_engine_decode_steps_go_to_the_ring_and_a_late_nan_keeps_its_channels(
        tmp_path, monkeypatch, fresh_adapter):
    """Two requests decode for 60 steps: every decode step has two token rows, yet only the
    prefill keeps its channel ranges for good; a weight row of `layers.1` turned NaN before
    decode step 45 makes that step's output channel 3 non-finite, and the trace keeps that
    step's channels and, copied out of the ring for good, those of the 8 steps before it
    (trigger_window). Expectations come from
    the construction (which steps exist, which row of which weight is NaN)."""
    r, cap = _ring_runner(tmp_path, monkeypatch, fresh_adapter, "ring_model_runner")
    n_decode, bad_decode = 60, 45
    try:
        r.dummy_run(8)  # warm-up, trace step 0
        ib = r.input_batch
        ib.req_ids = ["A", "B"]
        ib.num_prompt_tokens[:2] = [3, 2]
        r.execute_model(sched_output(["A", "B"], [3, 2], [5, 6, 7, 8, 9], [0, 1, 2, 0, 1], [2, 4]))
        r.sample_tokens()  # prefill, trace step 1
        for k in range(1, n_decode + 1):  # decode step k is trace step k + 1
            if k == bad_decode:
                with torch.no_grad():
                    r.model.layers[1].weight[3, :] = float("nan")
            ib.num_computed_tokens_cpu[:2] = [2 + k, 1 + k]
            r.execute_model(sched_output(["A", "B"], [1, 1], [10 + k % 20, 30 + k % 20],
                                   [2 + k, 1 + k], [0, 1]))
            r.sample_tokens()
    finally:
        cap.close()
    first_bad = bad_decode + 1
    with open_trace(tmp_path / "t-0.h5") as t:
        assert t.n_steps == n_decode + 2
        cols = t.record_columns(["step", "chan_offset", "flags"])
        kept = set(np.unique(cols["step"][cols["chan_offset"] >= 0]).tolist())
        # the prefill; the last 16 steps that went to the ring (the clean decode steps just
        # before the failure: every later step is kept); every failing step (all are under
        # trigger_limit); nothing of the warm-up or of the earlier decode steps
        assert kept == {1, *range(first_bad - 16, n_decode + 2)}
        trig = t.triggers
        assert int(trig["step"].min()) == first_bad
    with h5py.File(tmp_path / "t-0.h5", "r") as f:  # the window, copied out of the ring
        promoted = f["channels/promoted/step"][:].tolist()
    assert promoted == list(range(first_bad - 8, first_bad))
    with open_trace(tmp_path / "t-0.h5") as t:
        bad = t.nonfinite_record_steps()
        assert int(bad.min()) == first_bad
        out = t.channels_for("layers.1", first_bad, io=1)
        assert out is not None
        lo, hi = out
        assert np.isnan(lo[3]) and np.isnan(hi[3])  # no finite value in channel 3
        assert np.isfinite(np.delete(lo, 3)).all() and np.isfinite(np.delete(hi, 3)).all()
        before = t.channels_for("layers.1", first_bad - 1, io=1)
        assert before is not None and np.isfinite(before[0]).all()
        inp = t.channels_for("layers.1", first_bad)  # its input: still finite
        assert inp is not None and np.isfinite(inp[0]).all()


def test_a_new_requests_prefill_is_kept_without_tripping_the_growth_trigger(
        tmp_path, monkeypatch, fresh_adapter):
    """A prefill arriving between decode steps (continuous batching) reads a token whose
    embedding is 1,000x the others: kept as a prefill, it trips no outlier-growth trigger (its
    maxima are no trend of the decode steps) and copies no window out of the ring. The same
    token read by a later decode step does trip it."""
    r, cap = _ring_runner(tmp_path, monkeypatch, fresh_adapter, "prefill_model_runner")
    with torch.no_grad():
        r.model.embed.weight[49] *= 1000.0
    ib = r.input_batch
    try:
        ib.req_ids = ["A"]
        ib.num_prompt_tokens[:1] = [2]
        r.execute_model(sched_output(["A"], [2], [5, 6], [0, 1], [1]))  # step 0: prefill of A
        r.sample_tokens()
        for k in range(1, 11):  # steps 1-10: A decodes
            ib.num_computed_tokens_cpu[:1] = [1 + k]
            r.execute_model(sched_output(["A"], [1], [10 + k], [1 + k], [0]))
            r.sample_tokens()
        ib.req_ids = ["A", "B"]  # step 11: B's prefill (with token 49) beside A's decode
        ib.num_computed_tokens_cpu[:2] = [12, 0]
        ib.num_prompt_tokens[:2] = [2, 3]
        r.execute_model(sched_output(["A", "B"], [1, 3], [21, 7, 49, 8], [12, 0, 1, 2], [0, 3]))
        r.sample_tokens()
        for k in range(1, 11):  # steps 12-21: both decode; step 17 reads token 49
            ib.num_computed_tokens_cpu[:2] = [12 + k, 2 + k]
            tok_b = 49 if k == 6 else 30 + k
            r.execute_model(sched_output(["A", "B"], [1, 1], [21 + k, tok_b], [12 + k, 2 + k],
                                   [0, 1]))
            r.sample_tokens()
    finally:
        cap.close()
    with open_trace(tmp_path / "t-0.h5") as t:
        trig = t.triggers
        growth = trig[trig["kind"] == "outlier_growth"]
        assert growth["step"].tolist() == [17]
        cols = t.record_columns(["step", "chan_offset"])
        kept = set(np.unique(cols["step"][cols["chan_offset"] >= 0]).tolist())
    with h5py.File(tmp_path / "t-0.h5", "r") as f:
        promoted = f["channels/promoted/step"][:].tolist()
    # only the decode trigger's window, 9-16, less the prefill (kept for good, not in the ring)
    assert promoted == [s for s in range(17 - 8, 17) if s != 11]
    assert {0, 11, 17} <= kept


def _serve_two_steps(adapter_mod, mod, mode: str = "NONE") -> None:
    """Patch the stand-in runner module, load its model (capture attaches) with the
    compilation `mode`, serve a prefill of A and B and one decode step, close the capture."""
    adapter_mod.patch_runner_module(mod)
    r = mod.FakeModelRunner()
    r.vllm_config.compilation_config.mode = SimpleNamespace(name=mode)
    r.load_model()
    cap = adapter_mod._captures[id(r)]
    try:
        _two_steps(r)
    finally:
        cap.close()


def _two_steps(r) -> None:
    ib = r.input_batch
    ib.req_ids = ["A", "B"]
    ib.num_prompt_tokens[:2] = [3, 2]
    r.execute_model(sched_output(["A", "B"], [3, 2], [5, 6, 8, 8, 9], [0, 1, 2, 0, 1], [2, 4]))
    r.sample_tokens()
    ib.num_computed_tokens_cpu[:2] = [3, 2]
    r.execute_model(sched_output(["A", "B"], [1, 1], [11, 12], [3, 2], [0, 1]))
    r.sample_tokens()


def test_tied_lm_head_row_is_named_as_the_logits_producer(tmp_path, monkeypatch,
                                                          fresh_adapter):
    """vLLM applies lm_head through its logits processor, never through lm_head's forward. With
    lm_head tied to the embedding and the embedding's row 7 NaN (a token never read), the
    hidden states stay finite and logit 7 of every row is NaN: the producer is lm_head, from
    finite input, and the cause its weight's row 7, tied to the embedding."""
    from qforensics.analyze.analyzer import analyze_trace

    monkeypatch.setenv("QFORENSICS_TRACE", str(tmp_path / "t.h5"))
    mod = _runner_module("tied_model_runner")
    load = mod.FakeModelRunner.load_model

    def load_tied(self) -> None:  # the checkpoint as loaded, before capture attaches
        load(self)
        with torch.no_grad():
            self.model.lm_head.weight = self.model.embed.weight  # tied, as SmolLM2's
            self.model.embed.weight[7] = float("nan")

    mod.FakeModelRunner.load_model = load_tied
    _serve_two_steps(fresh_adapter, mod)
    rep = analyze_trace(str(tmp_path / "t.h5"))
    assert rep.status == "FAILED"
    first = rep.first_nonfinite
    assert first.producer == "lm_head" and first.tensor == "output"
    cause = rep.cause
    assert cause is not None and cause.kind == "corrupted_parameters", cause
    assert cause.module == "lm_head"
    t0 = cause.tensors[0]
    assert (t0["param"], t0["row"]) == ("weight", 7)
    assert "embed.weight" in cause.line, cause.line  # the tie is named


def test_compiled_runner_records_the_same_figures_as_eager(tmp_path, monkeypatch,
                                                         fresh_adapter):
    """Both runners, whether their config says vLLM compiles the model or not, get the stats
    op's torch-op hooks (here run eagerly: the stand-in does not compile); the records of the
    same steps are the same either way."""
    traces = {}
    for mode in ("NONE", "VLLM_COMPILE"):
        monkeypatch.setenv("QFORENSICS_TRACE", str(tmp_path / f"{mode}.h5"))
        _serve_two_steps(fresh_adapter, _runner_module(f"{mode.lower()}_model_runner"), mode)
        traces[mode] = open_trace(tmp_path / f"{mode}.h5")
    e, c = traces["NONE"], traces["VLLM_COMPILE"]
    assert c.meta["status"]["capture_mode"] == e.meta["status"]["capture_mode"] == "compiled"
    for step in (0, 1):
        _same_records(e, c, step)


def _same_records(e, c, step: int) -> None:  # noqa: ANN001
    """Step `step`'s records of trace `c` are those of trace `e` (figures to float32's
    rounding)."""
    a = e.records(step).sort_values(["call_index", "io", "slot"])
    b = c.records(step).sort_values(["call_index", "io", "slot"])
    cols = ["module_id", "io", "slot", "rows", "channels", "nan_count"]
    assert a[cols].values.tolist() == b[cols].values.tolist()
    for f in ("min", "max", "mean", "std"):
        np.testing.assert_allclose(b[f].values, a[f].values, rtol=1e-5, atol=1e-6)


def test_a_warmup_forward_on_nan_never_drives_the_verdict(tmp_path, monkeypatch,
                                                         fresh_adapter):
    """vLLM's compiled mode runs a warm-up forward on a dummy batch (token 0 everywhere); when
    that batch makes NaN (here: token 0's embedding row), the served steps that never read
    token 0 find no non-finite value (the stand-in's random head is near-uniform, which a
    precursor rule may call SUSPECT: not the question here)."""
    from qforensics.analyze.analyzer import analyze_trace

    r, cap = _loaded(tmp_path, monkeypatch, fresh_adapter, "warm_nan_runner")
    with torch.no_grad():
        r.model.embed.weight[0] = float("nan")
    try:
        r.dummy_run(4)
        _two_steps(r)
    finally:
        cap.close()
    with open_trace(tmp_path / "t.h5") as t:
        assert 0 in t.nonfinite_record_steps().tolist()  # the warm-up's records hold NaN
    rep = analyze_trace(str(tmp_path / "t.h5"))
    assert rep.status != "FAILED" and rep.first_nonfinite is None, rep.verdict.line


def test_compiled_runner_read_the_gpu_way_records_what_eager_records(tmp_path, monkeypatch,
                                                                      fresh_adapter):
    """The GPU's way of reading compiled steps (host copies of each slot, the logits row and
    the ids copied to the host slot at the step's end, a drainer thread; on the CPU through
    graphstats.HOST_COPIES_ON_CPU) on an engine, whose logits come from its own hook, not the
    root: the records, the input ids and the logits figures equal the eager capture's."""
    from qforensics.hooks import graphmode, graphstats

    traces = {}
    for mode in ("NONE", "VLLM_COMPILE"):
        with monkeypatch.context() as m:
            if mode == "VLLM_COMPILE":
                m.setattr(graphstats, "HOST_COPIES_ON_CPU", True)
                m.setattr(graphmode, "DRAIN", "thread")
            m.setenv("QFORENSICS_TRACE", str(tmp_path / f"{mode}.h5"))
            _serve_two_steps(fresh_adapter, _runner_module(f"{mode.lower()}_gpu_way_runner"),
                             mode)
        traces[mode] = open_trace(tmp_path / f"{mode}.h5")
    e, c = traces["NONE"], traces["VLLM_COMPILE"]
    assert c.meta["status"]["capture_mode"] == "compiled"
    assert c.meta["status"]["graph_drain"]["thread"]
    assert c.steps["step"].tolist() == e.steps["step"].tolist() == [0, 1]
    for step in (0, 1):
        np.testing.assert_array_equal(c.input_ids(step), e.input_ids(step))
        assert len(c.input_ids(step)) == (5 if step == 0 else 2)
        _same_records(e, c, step)
    for f in ("has_logits", "logits_argmax", "logits_min", "logits_max", "logits_mean",
              "logits_entropy"):
        np.testing.assert_allclose(c.steps[f].values, e.steps[f].values, rtol=1e-5, atol=1e-6,
                                   err_msg=f)
