"""The AWQ checkpoint written in AutoAWQ's published GEMM layout, run by vLLM's own CPU AWQ
kernel, with one group scale corrupted to +Inf: the analysis must name the layer, the step, the
output column and the scale vLLM holds. Expectations come from the corruption's definition
(demo.vllm_scenarios) and the AWQ format, not from the trace."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qforensics.analyze.analyzer import analyze_trace
from qforensics.demo import vllm_scenarios as sc
from qforensics.demo.vllm_checkpoints import AWQ_GROUP, awq_dequantize, awq_quantize
from qforensics.trace.reader import open_trace
from vllm_runs import PROMPT_A, PROMPT_B, run_recorded


def test_awq_packing_follows_the_autoawq_gemm_layout():
    # one pack of 8 output columns, values 0..7 in column order: AutoAWQ stores column
    # ORDER[i] in nibble i, ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
    k, n = AWQ_GROUP, 8
    w = torch.arange(n, dtype=torch.float32).repeat(k, 1).t().contiguous()  # [N, K], row n = n
    w[:, 0] = 0.0  # each group's min is 0 and max is n: zero point 0
    w[:, 1] = 15.0
    qw, qz, s = awq_quantize(w)
    assert qw.shape == (k, 1) and qz.shape == (1, 1) and s.shape == (1, n)
    assert torch.equal(s.float(), torch.ones(1, n)) and int(qz[0, 0]) == 0  # scale 1, zero 0
    word = int(qw[2, 0]) & 0xFFFFFFFF  # input row 2: output column c holds the value c
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == [0, 2, 4, 6, 1, 3, 5, 7]


def test_awq_round_trip_error_is_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(192, 576, generator=g)
    qw, qz, s = awq_quantize(w)
    d = awq_dequantize(qw, qz, s)
    step = s.float().repeat_interleave(AWQ_GROUP, 0).t()  # [N, K]
    assert bool(((d - w).abs() <= step / 2 + 1e-3).all())


@pytest.fixture(scope="module")
def awq_inf_run(tmp_path_factory):
    from qforensics.demo.vllm_checkpoints import checkpoint_dir

    model = checkpoint_dir("awq", "inf-group-scale")
    return run_recorded(tmp_path_factory.mktemp("awq-inf"), model, [PROMPT_A, PROMPT_B], 4)


@pytest.mark.vllm
@pytest.mark.w4a16
def test_vllm_runs_the_awq_checkpoint_with_its_awq_method(awq_inf_run):
    with open_trace(awq_inf_run["files"][0]) as t:
        eng = t.meta["environment"]["engine"]
    assert eng["quantization"] == "awq"
    methods = {v for k, v in eng["quant_methods"].items() if k.endswith("_proj")}
    assert methods and all("AWQ" in m.upper() for m in methods), methods
    h = eng["scale_health"][sc.AWQ_INF_LAYER]["scales"]
    assert h["inf"] == 1 and h["nan"] == 0
    others = [v["scales"]["inf"] + v["scales"]["nan"] for k, v in eng["scale_health"].items()
              if k != sc.AWQ_INF_LAYER and "scales" in v]
    assert others and not any(others)


@pytest.mark.vllm
@pytest.mark.w4a16
def test_analysis_names_layer_step_column_and_scale(awq_inf_run):
    f = analyze_trace(awq_inf_run["files"][0])
    assert f.status == "FAILED" and f.exit_code == 1
    first = f.first_nonfinite
    assert (first.module, first.step, first.tensor) == (sc.AWQ_INF_LAYER, 0, "output")
    with open_trace(awq_inf_run["files"][0]) as t:
        snap = t.snapshot_tensors(first.call_index)
        n_rows = len(t.engine_table("rows").query("step == 0"))
    cols = np.unique(snap["nonfinite_positions"][:, -1])
    assert cols.tolist() == [sc.AWQ_INF_COLUMN]
    # one non-finite value per token row, in that column: Inf through the W4A8 path (AMX),
    # NaN through the W4A16 GEMM (AVX-512 without AMX: the Inf scale meets zeros)
    assert first.inf_count + first.nan_count == n_rows
    text = "\n".join(f.notes)
    assert f"{sc.AWQ_INF_LAYER}.scales" in text and "1 Inf" in text


@pytest.mark.vllm
@pytest.mark.w4a16
def test_replay_says_why_it_cannot_read_the_w4a8_blocked_layout(awq_inf_run):
    """On AMX CPUs vLLM runs AWQ through its W4A8 path by default; replay refuses that blocked
    layout and says how to record the W4A16 one (AMX present: the layer says use_w4a8)."""
    import torch

    from qforensics.errors import ReplayError
    from qforensics.replay.run import replay

    if not torch.cpu._is_amx_tile_supported():  # vLLM took its W4A16 path: replay reads it
        from qforensics.replay.verdict import Verdict

        out = replay(awq_inf_run["files"][0], gpu_probe=lambda: (False, "test"))
        assert out.results[0].verdict is Verdict.DATA
        return
    with pytest.raises(ReplayError, match="VLLM_CPU_INT4_W4A8=0"):
        replay(awq_inf_run["files"][0], gpu_probe=lambda: (False, "test"))
