"""What capture and the guard read from vLLM's model runner, beside the runner wrappers of
qforensics.engines.vllm: the scheduler output of the forward being run, each token row's
request, position and phase, the runner's limits and compile mode, and what could not be
mapped (one stderr line each). Host-side state only: no device access, no torch import.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np

_current: dict[int, Any] = {}  # id(runner) -> scheduler output of the forward being run
_unmapped: list[str] = []


@contextmanager
def running(runner: Any, scheduler_output: Any) -> Iterator[None]:
    """`scheduler_output` is the forward `runner` runs inside this block."""
    _current[id(runner)] = scheduler_output
    try:
        yield
    finally:
        _current.pop(id(runner), None)


def scheduled(runner: Any) -> Any:
    """The scheduler output of the forward `runner` is running (None outside execute_model:
    a warm-up, profile or dummy run)."""
    return _current.get(id(runner))


def note_unmapped(what: str) -> None:
    """Say once, on stderr and in the trace's engine metadata, what vLLM capture could not map
    (the generic hooks stay in charge of it)."""
    if what not in _unmapped:
        _unmapped.append(what)
        sys.stderr.write(f"qforensics: vLLM: not mapped: {what}; generic hooks stay in charge\n")


def unmapped() -> list[str]:
    return list(_unmapped)


def max_batch_tokens(runner: Any) -> int:
    """The most token rows one forward of this runner carries (the scheduler's
    max_num_batched_tokens); 8192 when that cannot be read."""
    try:
        return max(1, int(runner.vllm_config.scheduler_config.max_num_batched_tokens))
    except Exception:
        return 8192


def compile_off(runner: Any) -> bool:
    """True when the runner does not compile the model (torch.compile mode NONE); False when it
    does or when that cannot be read."""
    try:
        mode = enum_name(getattr(runner.vllm_config.compilation_config, "mode", None))
    except Exception:
        return False
    return mode.upper() in ("NONE", "0")


def enum_name(v: Any) -> str:
    """NONE / VLLM_COMPILE / FULL_AND_PIECEWISE ... for vLLM's mode enums (int enums print as
    numbers)."""
    if v is None:
        return "unknown"
    return str(getattr(v, "name", v))


def runner_rows(runner: Any, sched: Any) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray,
                                                  np.ndarray]:
    """(request ids in batch order, prompt lengths, per-row request index into that list,
    per-row position, per-row phase 0 prefill / 1 decode) of the forward being run, from the
    runner's host-side input batch (no device access)."""
    ib = runner.input_batch
    req_ids = [r for r in list(ib.req_ids) if r is not None]
    nsched = sched.num_scheduled_tokens
    counts = np.array([int(nsched.get(r, 0)) for r in req_ids], np.int64)
    start = np.asarray(ib.num_computed_tokens_cpu[: len(req_ids)], np.int64)
    prompt = np.asarray(ib.num_prompt_tokens[: len(req_ids)], np.int64)
    req = np.repeat(np.arange(len(req_ids), dtype=np.int64), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    pos = np.repeat(start, counts) + (np.arange(int(counts.sum()), dtype=np.int64) - first)
    phase = (pos >= np.repeat(prompt, counts)).astype(np.int8)
    return req_ids, prompt, req, pos, phase
