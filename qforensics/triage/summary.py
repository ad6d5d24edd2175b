"""One trace -> one small plain dict: the Dask task of `qforensics triage`.

`summarize_trace(path)` opens the trace once, runs the analyzer on the open file and keeps only
what grouping needs (verdict, producer in HF spelling, cause kind and index, the producing
layer's quantization and kernel, versions, model, rank, prompt length, when). The dict holds
only str / int / float / bool values, so a worker ships a few hundred bytes back, never a
`Findings`. It never raises: a trace that cannot be read comes back with `status`
"UNREADABLE" and the reason; a bug in qforensics comes back with `internal` True, so it is
never read as a finding. Never prints; no torch import.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

from qforensics.analyze.analyzer import analyze_open_trace
from qforensics.analyze.findings import FAILED, Findings
from qforensics.analyze.thresholds import Thresholds
from qforensics.errors import QForensicsError
from qforensics.formats import GEMM_KINDS
from qforensics.trace.moduleinfo import read_module_quant
from qforensics.trace.reader import Trace, open_trace
from qforensics.triage.names import align_producer, producer_site, run_key

__all__ = ["UNREADABLE", "cause_index", "prompt_bucket", "summarize_trace", "unreadable_row"]

UNREADABLE = "UNREADABLE"
_TEXT = 300  # characters kept of any text that comes from the trace
_BUCKETS = (16, 64, 256, 1024, 4096, 16384)


def _text(v: Any, n: int = _TEXT) -> str:
    return v[:n] if isinstance(v, str) else ("" if v is None else str(v)[:n])


def _int(v: Any, default: int = -1) -> int:
    if isinstance(v, bool):
        return default
    try:
        return int(v)
    except (TypeError, ValueError, OverflowError):
        return default


def prompt_bucket(n: int) -> str:
    """Prompt lengths in coarse buckets: <=16, 17-64, 65-256, ... tokens."""
    if n <= 0:
        return "unknown"
    lo = 1
    for hi in _BUCKETS:
        if n <= hi:
            return f"{lo}-{hi}"
        lo = hi + 1
    return f">{_BUCKETS[-1]}"


def unreadable_row(path: str, reason: str, *, internal: bool = False) -> dict[str, Any]:
    return {"path": path, "status": UNREADABLE, "reason": _text(reason, 1000),
            "internal": internal, "verdict": "", "run": os.path.abspath(path), "rank": 0,
            "world_size": 1, "seconds": 0.0}


def summarize_trace(path: str, th: Thresholds | None = None) -> dict[str, Any]:
    """The triage row of one trace (see the module docstring)."""
    t0 = time.perf_counter()
    try:
        with open_trace(path) as trace:
            row = _summarize(trace, th or Thresholds())
    except QForensicsError as exc:
        return unreadable_row(path, str(exc))
    except Exception as exc:  # noqa: BLE001 - a bug on this input: reported, not a finding
        return unreadable_row(path, f"internal error ({type(exc).__name__}: {exc}); rerun "
                              f"`qforensics analyze {path}` with QFORENSICS_DEBUG=1",
                              internal=True)
    row["path"] = path
    row["seconds"] = round(time.perf_counter() - t0, 4)
    return row


# -- one open trace --------------------------------------------------------------------------------
def _summarize(trace: Trace, th: Thresholds) -> dict[str, Any]:
    f = analyze_open_trace(trace, th, verdict_only=True)
    meta = trace.meta
    env = meta.get("environment") if isinstance(meta.get("environment"), dict) else {}
    eng = env.get("engine") if isinstance(env.get("engine"), dict) else {}
    rank, world = max(0, _int(env.get("rank"), 0)), max(1, _int(env.get("world_size"), 1))
    if eng:
        engine = _text(eng.get("name") or "engine", 40)
        engine_version = _text(eng.get("version") or "unknown", 40)
    else:
        engine, engine_version = "transformers", _text(env.get("transformers") or "unknown", 40)
    row: dict[str, Any] = {
        "status": f.status, "verdict": _text(f.verdict.line, 600), "reason": "",
        "internal": False, "rank": rank, "world_size": world,
        "tp_rank": _int(eng.get("tp_rank"), rank if world > 1 else 0),
        "pp_rank": _int(eng.get("pp_rank"), 0),
        "run": run_key(trace.path, rank, world),
        "engine": engine, "engine_version": engine_version,
        "torch": _text(env.get("torch") or "unknown", 40),
        "model": _text(env.get("model_path") or env.get("model_class") or "unknown"),
        "host": _text(env.get("host") or "", 80),
        "compiled": bool(env.get("compiled")) if isinstance(env.get("compiled"), bool) else False,
        "dtype": ",".join(_text(d, 20) for d in env.get("dtypes", [])[:4])
        if isinstance(env.get("dtypes"), list) else "",
        "n_steps": f.n_steps, "step": -1, "call_index": -1,
        "producer_raw": "", "producer": "", "site": "",
        "cause": "", "cause_index": "", "cause_line": "", "method": "", "kernel": "",
    }
    row["prompt_tokens"] = _prompt_tokens(trace)
    row["prompt_bucket"] = prompt_bucket(row["prompt_tokens"])
    row["time"] = _first_time(trace, f)
    quant = read_module_quant(trace)
    row.update(_fleet_layers(trace, quant, eng))
    module = _producer(f, row)
    if module:
        row["method"] = _method(quant.get(module), eng)
        row["kernel"] = _kernel(trace, module, f, eng)
        row["producer"] = align_producer(module, eng.get("hf_names"))
        row["site"] = producer_site(row["producer"])
    return row


def _producer(f: Findings, row: dict[str, Any]) -> str:
    """Fills step, call, producer and cause; returns the module whose layer facts matter."""
    fn = f.first_nonfinite
    if fn is not None:
        row["step"], row["call_index"] = fn.step, fn.call_index
        if fn.producer_module is not None:
            module = fn.module
            row["producer_raw"] = module
        else:
            gap = fn.producer
            module = fn.module
            row["producer_raw"] = f"unhooked op before {fn.module}"
            row["cause"] = "unhooked_op"
            row["cause_line"] = _text(getattr(gap, "description", ""))
        if f.cause is not None:
            row["cause"] = f.cause.kind
            row["cause_index"] = cause_index(f.cause)
            row["cause_line"] = _text(f.cause.line)
        return module
    if f.status == FAILED:  # the summaries say NaN but the step's records are unreadable
        row["cause"] = "unknown"
        return ""
    silent = [e for e in f.evidence if e.suspect]
    if silent:
        e = silent[0]
        row["cause"] = _text(e.kind, 60)
        row["cause_line"] = _text(e.line)
        module = _text(e.modules[0]) if e.modules else ""
        row["producer_raw"] = module
        return module
    if f.status != "PASSED":
        row["cause"] = "damaged_trace" if f.notes else "incomplete"
        row["cause_line"] = _text(f.verdict.line)
    return ""


def cause_index(cause: Any) -> str:
    """Where the cause sits: the corrupt tensor and its row / group, the outlier channels, the
    overflowing format."""
    if cause.kind == "corrupted_parameters" and cause.tensors:
        parts = []
        for t in cause.tensors[:4]:
            s = _text(t.get("param"), 60)
            if isinstance(t.get("row"), int):
                s += f" row {t['row']}"
            if isinstance(t.get("group"), int):
                s += f" group {t['group']}"
            elif "zero_scales" in t:
                s += " zero scales"
            parts.append(s)
        return "; ".join(parts)
    if cause.channels:
        ch = sorted({int(c) for c in cause.channels})[:16]
        return "channels " + ",".join(map(str, ch))
    if cause.format:
        return _text(cause.format, 40)
    return ""


def _method(q: Any, eng: dict[str, Any]) -> str:
    """The producing layer's quantization: its recorded format, bits and group, else the
    engine's quantization config."""
    if isinstance(q, dict) and q:
        s = _text(q.get("format") or (f"int{q['bits']}" if isinstance(q.get("bits"), int)
                                      else "quantized"), 60)
        if isinstance(q.get("group_size"), int) and q["group_size"] > 0:
            s += f"-g{q['group_size']}"
        if q.get("target") in ("weights", "activations"):
            s += f" {q['target']}"
        if q.get("activations") == "static":
            s += " static-input"
        return s
    quant = eng.get("quantization")
    return _text(quant, 60) if isinstance(quant, str) and quant else "none"


def _kernel(trace: Trace, module: str, f: Findings, eng: dict[str, Any]) -> str:
    """The kernel the producing layer ran: the snapshot's call.json `kernel` when capture
    kept one, else the engine's quant method class, else the module's class."""
    fn = f.first_nonfinite
    if fn is not None and any(s.call_index == fn.call_index for s in f.snapshots):
        try:
            raw = trace.snapshot_tensors(fn.call_index, {"call.json"}).get("call.json")
            facts = json.loads(raw.tobytes()) if raw is not None else None
        except (QForensicsError, ValueError, TypeError, RecursionError):
            facts = None
        if isinstance(facts, dict) and isinstance(facts.get("kernel"), str) and facts["kernel"]:
            return _text(facts["kernel"], 80)
    methods = eng.get("quant_methods")
    if isinstance(methods, dict) and isinstance(methods.get(module), str):
        return _text(methods[module], 80)
    names = trace.module_names.tolist()
    if module in names:
        return _text(trace.module_columns["type"][names.index(module)], 80)
    return ""


def _fleet_layers(trace: Trace, quant: dict[str, dict[str, Any]], eng: dict[str, Any]
                  ) -> dict[str, str]:
    """The model-wide quantization and kernels (what healthy traces are compared on)."""
    cols = trace.module_columns
    gemm = [i for i, k in enumerate(cols["kind"].tolist()) if k in GEMM_KINDS]
    types = sorted({_text(cols["type"][i], 60) for i in gemm})[:4]
    methods = eng.get("quant_methods")
    if isinstance(methods, dict):
        types = sorted({_text(v, 60) for v in list(methods.values())[:4096]
                        if isinstance(v, str)})[:4] or types
    fmts = sorted({_method(q, eng) for q in list(quant.values())[:4096]})[:4]
    return {"kernels": ",".join(types), "methods": ",".join(fmts) or _method(None, eng)}


def _prompt_tokens(trace: Trace) -> int:
    reqs = trace.engine_columns("requests")
    if not reqs.empty and len(reqs["prompt_tokens"]):
        return max(0, int(reqs["prompt_tokens"].max()))
    st = trace.step_table
    return int(st["token_count"][0]) if len(st) else -1


def _first_time(trace: Trace, f: Findings) -> float:
    """Wall-clock start of the failing step, else of the first step (NaN when unknown)."""
    fn = f.first_nonfinite
    if fn is not None and math.isfinite(fn.t_start):
        return float(fn.t_start)
    st = trace.step_table
    if len(st) and math.isfinite(float(st["t_start"][0])):
        return float(st["t_start"][0])
    return float("nan")
