"""What Dynamo's guards cost each call of a compiled model, plain and under capture, side by side.

    python bench/compiled_guards.py                        # the real SmolLM2, CPU
    python bench/compiled_guards.py --random --layers 4    # SmolLM2's architecture, 4 layers
    python bench/compiled_guards.py --device cuda

Every call of a torch.compile'd model first checks its guards (Dynamo's cache look-up), on the
host, before any kernel runs: on a GPU decode step of ~2 ms that time is part of the step.
Forward hooks add guards: each hooked module's hook dict, the hook's code, what the hook reads
(closure cells, globals). vLLM drops every guard; a model compiled by its user
(`capture(torch.compile(model))`) checks them all at every call.

Each phase runs in a child process (two compiles of one model in one process would share
Dynamo's cache entries): `plain`, then `captured` (the same model under qforensics.capture).
Each compiles with the `eager` backend (guards come from Dynamo's trace, whatever the backend)
and calls the model on a 4-token input. Printed, one JSON line per phase, then the comparison:
- `check_us`: one check of the compiled frame's guards against this call's arguments, timed
  directly (the guard manager's `check`, 200 times): the guards' own time a call;
- `leaf_guards`: the guards in that frame's guard tree;
- `guard_ms`: a call's median time with guards checked less with them skipped
  (`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`), in alternating rounds: what
  Dynamo's whole cache look-up costs a call, noisier (it moves by a millisecond between runs on
  a 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _guards(model, x) -> dict:  # noqa: ANN001
    """The compiled frame's guards: their count (leaf guards) and the time of one check of
    them all against this call's frame (`check`, timed directly; None where this torch does
    not say, or the frame's arguments are not (model, input))."""
    try:
        import torch._dynamo.convert_frame as cf
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return {"leaf_guards": None, "check_us": None}
    leaves, check_us = 0, None
    for ref in list(cf.input_codes.seen):
        code = ref()
        for e in _debug_get_cache_entry_list(code) if code is not None else []:
            gm = e.guard_manager
            leaves += _count(gm.root)
            names, argc = code.co_varnames, code.co_argcount
            if argc >= 2:
                loc = {names[0]: model, names[1]: x}
            elif code.co_flags & 0x04:  # f(*args, **kwargs), f(self, *args, **kwargs)
                pos = (model, x)
                loc = {**dict(zip(names[:argc], pos)), names[argc]: pos[argc:],
                       **({names[argc + 1]: {}} if code.co_flags & 0x08 else {})}
            else:
                continue
            fn = getattr(type(model), "forward", None)  # its free variables (a decorator's)
            if getattr(fn, "__code__", None) is code and fn.__closure__:
                loc.update(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__)))
            if not gm.check(loc):
                continue  # not this call's frame, or arguments this guess missed
            n, t0 = 200, time.perf_counter()
            for _ in range(n):
                gm.check(loc)
            check_us = round((time.perf_counter() - t0) / n * 1e6, 1)
    return {"leaf_guards": leaves or None, "check_us": check_us}


def _count(node) -> int:  # noqa: ANN001
    kids = node.get_child_managers() if hasattr(node, "get_child_managers") else []
    return len(node.get_leaf_guards()) + sum(_count(k) for k in kids)


def child(a: argparse.Namespace) -> dict:
    import torch

    from compiled_capture import build

    model, ids, how = build(a)
    torch.set_num_threads(a.threads)
    x = torch.tensor([ids[:4]], device=a.device)
    comp = torch.compile(model, backend="eager")
    ctx = None
    if a.phase == "captured":
        import qforensics

        ctx = qforensics.capture(comp, os.path.join(tempfile.mkdtemp(prefix="qf-guards-"),
                                                    "t.h5"))
        ctx.__enter__()

    def sync() -> None:
        if x.device.type == "cuda":
            torch.cuda.synchronize()

    def median_ms(n: int) -> float:
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            comp(x)
            sync()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e3

    with torch.no_grad():
        t0 = time.perf_counter()
        comp(x)
        first = time.perf_counter() - t0
        for _ in range(3):
            comp(x)
        checked, skipped = [], []
        for _ in range(a.rounds):
            checked.append(median_ms(a.calls))
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                skipped.append(median_ms(a.calls))
    out = {"phase": a.phase, "model": how, "device": a.device, "layers":
           model.config.num_hidden_layers, "first_call_s": round(first, 2),
           "call_ms": round(statistics.median(checked), 3),
           "call_ms_guards_skipped": round(statistics.median(skipped), 3),
           "guard_ms": round(statistics.median(checked) - statistics.median(skipped), 3)}
    with torch.no_grad():
        out.update(_guards(model, x))
    if ctx is not None:
        ctx.__exit__(None, None, None)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--layers", type=int, default=0, help="keep the first N layers (0: all)")
    ap.add_argument("--random", action="store_true", help="random weights, SmolLM2's shapes")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of checked/skipped calls")
    ap.add_argument("--calls", type=int, default=20, help="timed calls per round and mode")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier)")
    ap.add_argument("--phase", choices=("plain", "captured"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.phase:
        print(json.dumps(child(a)))
        return 0
    got = {}
    for phase in ("plain", "captured"):
        cmd = [sys.executable, os.path.abspath(__file__), "--phase", phase, "--device", a.device,
               "--dtype", a.dtype, "--layers", str(a.layers), "--rounds", str(a.rounds),
               "--calls", str(a.calls), "--threads", str(a.threads)] + (
                   ["--random"] if a.random else [])
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            print(r.stderr[-3000:], file=sys.stderr)
            return 3
        got[phase] = json.loads(r.stdout.strip().splitlines()[-1])
        print(json.dumps(got[phase]))
    p, c = got["plain"], got["captured"]
    print(json.dumps({"check_us": [p["check_us"], c["check_us"]],
                      "guard_ms_added": round(c["guard_ms"] - p["guard_ms"], 3),
                      "guard_ratio": round(c["guard_ms"] / p["guard_ms"], 2)
                      if p["guard_ms"] > 0 else None,
                      "call_ratio": round(c["call_ms"] / p["call_ms"], 3),
                      "leaf_guards": [p["leaf_guards"], c["leaf_guards"]]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
