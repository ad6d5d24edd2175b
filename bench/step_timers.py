"""Timers around capture's main functions, for the benchmarks' `--profile` (where a captured
step's time goes). Each wrapped call costs about a microsecond more: a small function's figure
is inflated by that much per call, and the timed run is slower than an untimed one. The hooked
modules' own hooks (hooks/graphhooks.py) are not wrapped: on the CPU most of their op calls run
in C (hooks/opcall.c)."""

from __future__ import annotations

import collections
import importlib
import time

# (module, class or None for a module function, name)
PROFILED = [
    ("qforensics.hooks.callhooks", "CallHooks", "_on_root_pre"),
    ("qforensics.hooks.callhooks", "CallHooks", "_close_root"),
    ("qforensics.engines.vllm_capture", "VllmAdapter", "on_logits"),
    ("qforensics.engines.vllm_capture", "VllmAdapter", "step_began"),
    ("qforensics.engines.vllm_capture", "VllmAdapter", "on_runner_output"),
    ("qforensics.hooks.session", "Capture", "_end_step"),
    ("qforensics.hooks.recorder", "FlightRecorder", "apply"),
    ("qforensics.trace.writer", "TraceWriter", "submit"),
    ("qforensics.trace.writer", "TraceWriter", "_write"),
    ("qforensics.trace.columns", "ColumnWriter", "_write_ring"),
    ("qforensics.trace.writer", "TraceWriter", "_append_batch"),
    ("qforensics.trace.writer", None, "merge_batches"),
    ("h5py._hl.files", "File", "flush"),
    ("qforensics.trace.budget", "BudgetWriter", "_note"),
    ("qforensics.trace.budget", "BudgetWriter", "_write_summary"),
    ("qforensics.trace.budget", "BudgetWriter", "_pin"),
    ("qforensics.trace.hits", "HitsWriter", "_note_hits"),
    ("qforensics.trace.columns", "ColumnWriter", "_append_table"),
    ("qforensics.hooks.stepend", None, "build_batch"),
    ("qforensics.hooks.reduce", None, "fast_logits"),
    ("qforensics.hooks.reduce", None, "nonfinite_rows"),
    # compiled mode (hooks/graphmode.py, hooks/graphread.py)
    ("qforensics.hooks.graphmode", "GraphMode", "_graph_root"),
    ("qforensics.hooks.graphlate", "GraphLate", "_graph_end"),
    ("qforensics.hooks.graphmode", "GraphMode", "_graph_flush"),  # the logits' op call
    ("qforensics.hooks.graphread", "RingReader", "collect_many"),  # GraphStats inherits it
    ("qforensics.hooks.stepend", "StepEnd", "_emit_batch"),
    # the stats op's CPU kernel, called from inside the compiled graph
    ("qforensics.hooks.statscpu", None, "stats_cpu"),
    ("qforensics.hooks.statscpu", None, "_group_c"),
]


def profile() -> tuple[dict, dict]:
    """Wrap the functions of PROFILED with timers: (nanoseconds, calls) by name. Call it
    before the capture is attached (hooks bind their methods then)."""
    spent: dict[str, int] = collections.Counter()
    calls: dict[str, int] = collections.Counter()
    for mod_name, cls_name, name in PROFILED:
        mod = importlib.import_module(mod_name)
        owner = getattr(mod, cls_name) if cls_name else mod
        fn = owner.__dict__.get(name) if cls_name else getattr(mod, name)
        if fn is None:  # inherited: the subclass's own entry wraps it
            continue
        key = f"{cls_name}.{name}" if cls_name else name

        def timed(*args, _fn=fn, _key=key, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent[_key] += time.perf_counter_ns() - t0
                calls[_key] += 1

        setattr(owner, name, timed)
    return spent, calls


def report(spent: dict, calls: dict, steps: int) -> None:
    """Print ms per step, calls per step and us per call, largest first."""
    for k, ns in sorted(spent.items(), key=lambda kv: -kv[1]):
        c = calls[k]
        print(f"  {k:<32} {ns / 1e6 / steps:7.3f} ms/step  {c / steps:6.1f} calls/step  "
              f"{ns / 1e3 / max(c, 1):8.1f} us/call")
