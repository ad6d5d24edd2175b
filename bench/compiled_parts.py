"""The parts of bench/compiled_capture.py that run inside a phase's child process besides its
step loop: the KV-cache step, what Inductor generated and how long its compile took, and the
facts read back from the captured trace."""

from __future__ import annotations


def kv_forward(comp, model, width: int, dev):  # noqa: ANN001, ANN202
    """The step of a static-KV-cache generation: step 0 the prompt (`n` positions), then the
    last token at its position; the cache (transformers' StaticCache, sized for the run) is
    filled in place, so both graphs keep their shapes."""
    import inspect

    import torch
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=width)
    key = ("cache" if "cache" in inspect.signature(model.forward).parameters
           else "past_key_values")
    pos = torch.arange(width, device=dev)

    def forward(x, n: int, i: int):  # noqa: ANN001, ANN202
        lo = 0 if i == 0 else n - 1
        return comp(input_ids=x[:, lo:n], cache_position=pos[lo:n], use_cache=True,
                    **{key: cache})

    return forward


def output_code() -> dict:
    """Inductor's output code of this process: kernels it generated, stats-op calls."""
    from torch._inductor.codecache import PyCodeCache

    kernels = calls = 0
    for mod in list(PyCodeCache.modules):
        try:
            with open(mod.__file__) as f:
                src = f.read()
        except (OSError, AttributeError, TypeError):
            continue
        kernels += src.count("async_compile.cpp_pybinding(") + src.count(
            "async_compile.triton(") + src.count("async_compile.cpp(")
        calls += src.count("torch.ops.qforensics.stats.default(")
    return {"generated_kernels": kernels, "stats_op_calls": calls}


# torch._dynamo.utils.compile_times' totals worth comparing: the whole compile, Dynamo's
# symbolic run of the Python (the hooks' share of a capture's compile), building the guards,
# and AOTAutograd with Inductor
COMPILE_PHASES = ("_compile.compile_inner", "bytecode_tracing", "build_guards",
                  "create_aot_dispatcher_function")


def compile_phases() -> dict:
    """Seconds spent in each of COMPILE_PHASES in this process (empty where this torch does
    not say)."""
    try:
        from torch._dynamo.utils import compile_times

        text = compile_times(repr="str", aggregate=True)
    except Exception:  # noqa: BLE001 - a torch without the table: no phases
        return {}
    got = {}
    for line in str(text).splitlines():
        name, _, value = line.rpartition(",")
        if name.strip() in COMPILE_PHASES:
            try:
                got[name.strip()] = round(float(value), 2)
            except ValueError:
                continue
    return got


def trace_facts(path: str) -> dict:
    import qforensics
    from qforensics.analyze.analyzer import analyze_trace

    t = qforensics.open_trace(path)
    rec = t.records()
    n_mod = len(t.module_columns["name"])
    per_step = rec.groupby("step").module_id.nunique()
    f = analyze_trace(path)
    return {"modules": n_mod, "steps": int(len(t.steps)),
            "every_module_every_step": bool(len(per_step) == len(t.steps)
                                            and (per_step == n_mod).all()),
            # steps whose detail the drainer gave up, lagging (complete 2: no records)
            "spilled_steps": int((t.steps["complete"] == 2).sum()),
            "capture_mode": t.meta["status"].get("capture_mode"),
            "graph_calls": t.meta["status"].get("graph_calls"),
            "numpy_redos": t.meta["status"].get("graph_numpy_redos", {}),
            "stats_kernel": (t.meta["status"].get("stats_kernel") or {}).get("kernel"),
            "graph_ring": t.meta["status"].get("graph_ring"),
            "graph_drain": t.meta["status"].get("graph_drain"),
            "verdict": f.verdict.line,
            "cause": f.cause.line if f.cause is not None else None}
