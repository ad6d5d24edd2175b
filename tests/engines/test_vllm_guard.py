"""The guard inside vLLM (`qforensics record --guard`) on the real AWQ checkpoint with one +Inf
group scale (`vllm-awq-inf-scale`), served by vLLM's own AWQ kernels.

Expectations come from outside the guard: the corrupted layer, group and column from the
scenario's definition (demo.vllm_scenarios); the tokens to agree with from a healthy run of the
same AWQ checkpoint without the corruption (`vllm-awq`), through the same kernel. The guarded
run is scored teacher-forced on the healthy run's prompt + answer (`vllm_serve --score-ids`):
at each answer position, is the guarded model's top-1 the healthy run's token?

W4A16: VLLM_CPU_INT4_W4A8=0 (vLLM's CPU W4A16 kernel; the guard reads its repacked weights).
Default kernel: on an AMX CPU vLLM takes its W4A8 path (weights blocked at load), which the
guard dequantizes through the layer's own quant method; on another CPU it is W4A16 again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from qforensics.analyze.analyzer import analyze_trace
from qforensics.demo import vllm_scenarios as sc
from qforensics.trace import schema
from qforensics.trace.reader import open_trace
from vllm_runs import PROMPT_A, PROMPT_B, one_core, side_by_side

pytestmark = [pytest.mark.vllm, pytest.mark.w4a16]  # every run serves the AWQ checkpoint

PROMPTS = [PROMPT_A, PROMPT_B, "Once upon a time", "The best way to learn a language is"]
N_TOKENS = 12
REPO = Path(__file__).resolve().parents[2]


def _record(tmp: Path, variant: str, w4a8: str | None, *, guard: bool,
            score: list[list[int]] | None = None, core: int = 0) -> dict:
    """`qforensics record [--guard] -- python -m qforensics.demo.vllm_serve AWQ_DIR ...`, its
    worker on the `core`-th core (vllm_runs.one_core), so that runs side by side overlap."""
    from qforensics.demo.vllm_checkpoints import checkpoint_dir

    out = tmp / "out.json"
    serve = [str(checkpoint_dir("awq", variant)), "--out", str(out)]
    if score is None:
        serve += ["--max-tokens", str(N_TOKENS)] + [a for p in PROMPTS for a in ("--prompt", p)]
    else:
        (tmp / "ids.json").write_text(json.dumps(score))
        serve += ["--score-ids", str(tmp / "ids.json")]
    cmd = [sys.executable, "-c", "from qforensics.cli import main; main()", "record", "-o",
           str(tmp / "t-{rank}.h5"), *(["--guard"] if guard else []), "--", sys.executable,
           "-m", "qforensics.demo.vllm_serve", *serve]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **one_core(core),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("VLLM_CPU_INT4_W4A8", None)
    if w4a8 is not None:
        env["VLLM_CPU_INT4_W4A8"] = w4a8
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-4000:]
    files = sorted(tmp.glob("t-*.h5"))
    assert len(files) == 1, files
    return {"out": json.loads(out.read_text()), "trace": files[0], "stderr": proc.stderr}


def _answers(run: dict) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, generated ids) per prompt of a free-running run."""
    return [(o["prompt_token_ids"], o["token_ids"]) for o in run["out"]["runs"][-1]["outputs"]]


def _agreement(healthy: dict, scored: dict) -> tuple[int, int]:
    """Teacher-forced top-1 agreement of `scored` with the healthy run's answer tokens."""
    hit = total = 0
    for (prompt, answer), s in zip(_answers(healthy), scored["out"]["scores"]):
        top1 = s["top1"][len(prompt) - 1:]  # top1[i] predicts token i + 1 of the sequence
        assert len(top1) == len(answer)
        hit += sum(int(a == b) for a, b in zip(answer, top1))
        total += len(answer)
    return hit, total


def _incidents(path: Path) -> list:
    with open_trace(path) as t:
        return list(t.incidents.itertuples(index=False))


def _logits_nonfinite_by_step(path: Path) -> dict[int, int]:
    """NaN + Inf of the recorded logits (the root's output slot 0) per non-warm-up step."""
    out = {}
    with open_trace(path) as t:
        root = int(t.modules.index[t.modules["name"] == ""][0])
        warm = set(t.engine_table("steps").query("warmup == 1")["step"].tolist())
        for step in t.steps["step"].tolist():
            if step in warm:
                continue
            r = t.records(int(step))
            r = r[(r["module_id"] == root) & (r["io"] == schema.IO_OUTPUT) & (r["slot"] == 0)]
            out[int(step)] = int((r["nan_count"] + r["inf_count"]).sum())
    return out


def _amx() -> bool:
    """vLLM takes W4A8 only with AMX (its mixed_precision/cpu.py: use_w4a8 = the variable and
    AMX): without, its default kernel is the W4A16 one the pinned runs use, the same engine."""
    return bool(torch.cpu._is_amx_tile_supported())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every engine run of this file, in two rounds of runs side by side
    (vllm_runs.side_by_side; the checks read incidents, traces and scores, not timing): the
    healthy and unguarded runs (and on an AMX CPU the healthy run with vLLM's default kernel),
    then each guarded run, scored on its healthy run's answers."""
    mk = tmp_path_factory.mktemp
    first = {"healthy": lambda: _record(mk("healthy"), "ok", "0", guard=False, core=0),
             "unguarded": lambda: _record(mk("unguarded"), "inf-group-scale", "0",
                                          guard=False, core=1)}
    if _amx():
        first["healthy_d"] = lambda: _record(mk("healthy-default"), "ok", None, guard=False,
                                             core=0)
    got = side_by_side(first)

    def guarded(healthy: str, w4a8: str | None, name: str, core: int):
        ids = [p + a for p, a in _answers(got[healthy])]
        return lambda: _record(mk(name), "inf-group-scale", w4a8, guard=True, score=ids,
                               core=core)

    second = {"guarded": guarded("healthy", "0", "guarded", 0)}
    if _amx():
        second["guarded_d"] = guarded("healthy_d", None, "guarded-default", 1)
    got.update(side_by_side(second))
    return got


@pytest.fixture(scope="module")
def healthy(runs):
    return runs["healthy"]


@pytest.fixture(scope="module")
def unguarded(runs):
    return runs["unguarded"]


@pytest.fixture(scope="module")
def guarded(runs):
    return runs["guarded"]


def test_without_the_guard_logits_are_nonfinite_and_text_degenerate(unguarded):
    bad = _logits_nonfinite_by_step(unguarded["trace"])
    assert bad and all(v > 0 for v in bad.values()), bad
    for _prompt, answer in _answers(unguarded):
        assert len(set(answer)) == 1, answer  # one token repeated: the "!!!!" failure
    f = analyze_trace(unguarded["trace"])
    assert f.status == "FAILED" and f.first_nonfinite.module == sc.AWQ_INF_LAYER
    assert not _incidents(unguarded["trace"])


def test_guard_names_the_layer_and_every_request(guarded):
    inc = _incidents(guarded["trace"])
    by_action: dict[str, list] = {}
    for i in inc:
        by_action.setdefault(i.action, []).append(i)
    first = by_action["fallback"][0]
    assert first.module == sc.AWQ_INF_LAYER and first.nan_count + first.inf_count > 0
    assert {i.module for i in by_action["fallback"]} == {sc.AWQ_INF_LAYER}
    deq = by_action["dequantized"]
    assert [i.module for i in deq] == [sc.AWQ_INF_LAYER]
    # one +Inf scale: the W4A16 reader re-estimates that one group scale
    assert "vllm-cpu-w4a16" in deq[0].detail and "1 NaN/Inf group scale" in deq[0].detail
    # every token row passes through the layer, and its input channels of the corrupted group
    # (AWQ_INF_GROUP * G .. + G) feed the Inf scale's column: every request is reported, once
    served = {s["request_id"] for s in guarded["out"]["scores"]}
    with open_trace(guarded["trace"]) as t:
        req = t.engine_table("requests")
    assert {i.detail.split(":")[0].removeprefix("request ") for i in by_action[
        "request_repaired"]} == {r.decode() if isinstance(r, bytes) else r
                                 for r in req["request_id"]}
    assert len(by_action["request_repaired"]) == len(served) == len(PROMPTS)
    assert "request_sanitized" not in by_action and "guard_off" not in by_action


def test_guarded_logits_are_finite_and_tokens_follow_the_healthy_run(guarded, healthy):
    bad = _logits_nonfinite_by_step(guarded["trace"])
    assert bad and not any(bad.values()), bad
    for s in guarded["out"]["scores"]:
        assert np.isfinite(s["token_logprobs"]).all()
    hit, total = _agreement(healthy, guarded)
    print(f"W4A16 guarded vs healthy, teacher-forced top-1: {hit}/{total}")
    assert total == N_TOKENS * len(PROMPTS)
    assert hit / total >= 0.85, (hit, total)


@pytest.fixture(scope="module")
def default_kernel_runs(runs):
    """The healthy and guarded runs with vLLM's default kernel: W4A8 on an AMX CPU; elsewhere
    the W4A16 kernel the runs above pin (the test reads which ran from the guard's incident)."""
    if not _amx():
        return runs["healthy"], runs["guarded"]
    return runs["healthy_d"], runs["guarded_d"]


def test_guard_with_the_default_kernel(default_kernel_runs):
    healthy_d, guarded_d = default_kernel_runs
    inc = _incidents(guarded_d["trace"])
    deq = [i for i in inc if i.action == "dequantized"]
    assert [i.module for i in deq] == [sc.AWQ_INF_LAYER]
    w4a8 = torch.cpu._is_amx_tile_supported()  # vLLM's default: W4A8 on AMX CPUs
    assert ("quant method on identity" if w4a8 else "vllm-cpu-w4a16") in deq[0].detail
    assert "1 NaN/Inf group scale" in deq[0].detail
    assert not any(i.action in ("request_sanitized", "guard_off") for i in inc)
    bad = _logits_nonfinite_by_step(guarded_d["trace"])
    assert bad and not any(bad.values()), bad
    hit, total = _agreement(healthy_d, guarded_d)
    print(f"default kernel ({'W4A8' if w4a8 else 'W4A16'}) guarded vs healthy, teacher-forced "
          f"top-1: {hit}/{total}")
    assert hit / total >= 0.6, (hit, total)


def test_the_trace_records_vllms_model_argument(healthy):
    from qforensics.demo.vllm_checkpoints import checkpoint_dir

    with open_trace(healthy["trace"]) as t:
        assert t.meta["environment"]["model_path"] == str(checkpoint_dir("awq", "ok").resolve())
