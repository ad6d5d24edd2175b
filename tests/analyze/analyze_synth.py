"""Synthetic traces for the analyzer tests, written with TraceWriter (no torch).

A tiny numpy "decoder": per layer q_proj -> o_proj (residual add) -> up_proj -> down_proj
(residual add), each a hooked linear, the layer itself a hooked block, and the root whose output
is the logits. Unhooked ops sit between hooked calls (an RMS norm before q_proj and up_proj, a
squashing activation before down_proj), so a value produced there shows up first in an input.
`tamper(step, layer, module, stage, array) -> array` lets a test inject NaN/Inf/outliers at a
hooked output (stage "out") or in an unhooked op (stage "in": the value the next hooked call
receives). Every statistic is computed from the real arrays, like capture does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qforensics.trace import schema
from qforensics.trace.writer import StepBatch, TraceWriter

LINEARS = ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")
Tamper = Callable[[int, int, str, str, np.ndarray], np.ndarray]


def module_table(n_layers: int) -> list[dict[str, str]]:
    mods = []
    for i in range(n_layers):
        for lin in LINEARS:
            mods.append({"name": f"model.layers.{i}.{lin}", "type": "Linear", "kind": "linear",
                         "info": "{}"})
        mods.append({"name": f"model.layers.{i}", "type": "DecoderLayer", "kind": "block",
                     "info": "{}"})
    mods.append({"name": "", "type": "TinyLM", "kind": "root", "info": "{}"})
    return mods


def reduce(arr: np.ndarray) -> dict[str, Any]:
    """Finite-only statistics of one (tokens, channels) array, as capture records them."""
    a = np.asarray(arr, np.float64)
    a2 = a.reshape(-1, a.shape[-1])
    fin = np.isfinite(a2)
    vals = a2[fin]
    out: dict[str, Any] = {"numel": a2.size, "rows": a2.shape[0], "channels": a2.shape[1],
                           "nan_count": int(np.isnan(a2).sum()),
                           "inf_count": int(np.isinf(a2).sum())}
    if vals.size:
        out.update(min=vals.min(), max=vals.max(), mean=vals.mean(), std=vals.std(),
                   absmax=np.abs(vals).max())
    else:
        out.update(min=np.nan, max=np.nan, mean=np.nan, std=np.nan, absmax=np.nan)
    big = np.where(fin, a2, np.nan)
    with np.errstate(all="ignore"):
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out["cmin"] = np.nanmin(big, axis=0)
            out["cmax"] = np.nanmax(big, axis=0)
            out["tok"] = np.nan_to_num(np.nanmax(np.abs(big), axis=1), nan=0.0)
    return out


@dataclass
class TinyModel:
    n_layers: int = 3
    channels: int = 64
    vocab: int = 50
    seed: int = 0
    weights: dict[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        C = self.channels
        for i in range(self.n_layers):
            self.weights[f"{i}.q"] = rng.normal(0, 1 / math.sqrt(C), (C, C))
            self.weights[f"{i}.o"] = rng.normal(0, 0.5 / math.sqrt(C), (C, C))
            self.weights[f"{i}.up"] = rng.normal(0, 1 / math.sqrt(C), (C, 2 * C))
            self.weights[f"{i}.down"] = rng.normal(0, 0.5 / math.sqrt(2 * C), (2 * C, C))
        self.weights["lm"] = rng.normal(0, 1 / math.sqrt(C), (C, self.vocab))
        self.embed = rng.normal(0, 1, (self.vocab, C))


def _norm(x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + 1e-6)


class Recorder:
    """Collects the calls of one step into a StepBatch."""

    def __init__(self, module_ids: dict[str, int], first_call: int) -> None:
        self.ids = module_ids
        self.call = first_call
        self.first_call = first_call
        self.recs: list[tuple] = []
        self.cmin: list[np.ndarray] = []
        self.cmax: list[np.ndarray] = []
        self.tok: list[np.ndarray] = []
        self.n_chan = 0
        self.n_tok = 0

    def add_call(self, name: str, inputs: list[np.ndarray], outputs: list[np.ndarray]) -> None:
        ci = self.call
        self.call += 1
        for io, tensors in ((0, inputs), (1, outputs)):
            for slot, t in enumerate(tensors):
                st = reduce(t)
                self.recs.append((ci, self.ids[name], io, slot, st, self.n_chan, self.n_tok))
                self.cmin.append(st["cmin"])
                self.cmax.append(st["cmax"])
                self.tok.append(st["tok"])
                self.n_chan += st["channels"]
                self.n_tok += st["rows"]

    def batch(self, step: int, logits: np.ndarray | None, ids: np.ndarray, t_start: float,
              logits_override: dict[str, Any] | None = None) -> StepBatch:
        rec = np.zeros(len(self.recs), schema.record_dtype())
        for k, (ci, mid, io, slot, st, co, to) in enumerate(self.recs):
            r = rec[k]
            r["call_index"], r["step"], r["module_id"], r["io"], r["slot"] = ci, step, mid, io, slot
            r["dtype"] = schema.DTYPE_CODES["float32"]
            for f in ("numel", "rows", "channels", "min", "max", "mean", "std", "absmax",
                      "nan_count", "inf_count"):
                r[f] = st[f]
            r["chan_offset"], r["tok_offset"], r["tok_count"] = co, to, st["rows"]
        s = np.zeros(1, schema.step_dtype())[0:1]
        s["step"] = step
        s["t_start"] = t_start
        s["duration"] = 0.01
        s["complete"] = 1
        s["record_count"] = len(rec)
        s["first_call"] = self.first_call
        s["n_calls"] = self.call - self.first_call
        bad = (rec["nan_count"] + rec["inf_count"]) > 0
        s["n_nonfinite_records"] = int(bad.sum())
        s["first_nonfinite_record"] = int(np.argmax(bad)) if bad.any() else -1
        ob = bad & (rec["io"] == 1)
        s["first_nonfinite_call"] = int(rec["call_index"][np.argmax(ob)]) if ob.any() else -1
        s["token_count"] = len(ids)
        if logits is not None:
            v = logits[-1].astype(np.float64)
            fin = np.isfinite(v)
            s["has_logits"] = 1
            if fin.any():
                vf = v[fin]
                p = np.exp(vf - vf.max())
                p /= p.sum()
                ent = float(-(p * np.log(np.where(p > 0, p, 1))).sum())
                s["logits_min"], s["logits_max"] = vf.min(), vf.max()
                s["logits_mean"], s["logits_std"], s["logits_entropy"] = vf.mean(), vf.std(), ent
            else:
                for f in ("logits_min", "logits_max", "logits_mean", "logits_std",
                          "logits_entropy"):
                    s[f] = np.nan
            s["logits_nan"] = int(np.isnan(v).sum())
            s["logits_inf"] = int(np.isinf(v).sum())
            order = np.argsort(-np.where(np.isnan(v), -np.inf, v), kind="stable")[:5]
            s["logits_argmax"] = -1 if np.isnan(v).any() else int(order[0])
            s["logits_top5_ids"] = order
            s["logits_top5_values"] = v[order]
        else:
            s["logits_argmax"] = -1
            s["logits_top5_ids"] = -1
        for k, v in (logits_override or {}).items():
            s[k] = v
        return StepBatch(steps=s, records=rec,
                         chan_min=np.concatenate(self.cmin) if self.cmin else np.zeros(0),
                         chan_max=np.concatenate(self.cmax) if self.cmax else np.zeros(0),
                         tok_absmax=np.concatenate(self.tok).astype(np.float32) if self.tok
                         else np.zeros(0, np.float32),
                         input_ids=ids.astype(np.int64))


def _identity(step: int, layer: int, module: str, stage: str, x: np.ndarray) -> np.ndarray:
    return x


def run_model(model: TinyModel, n_steps: int, prompt_len: int = 6, *,
              tamper: Tamper | None = None,
              logits_override: Callable[[int], dict[str, Any] | None] | None = None,
              token_override: Callable[[int], int | None] | None = None,
              seed: int = 1) -> list[StepBatch]:
    """Greedy generation: step 0 is the prefill of `prompt_len` tokens, then one token per step."""
    tamper = tamper or _identity
    mods = module_table(model.n_layers)
    ids_of = {m["name"]: i for i, m in enumerate(mods)}
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, model.vocab, prompt_len)
    batches = []
    call = 0
    W = model.weights
    for step in range(n_steps):
        step_ids = tokens if step == 0 else tokens[-1:]
        rec = Recorder(ids_of, call)
        h = model.embed[step_ids].copy()
        for i in range(model.n_layers):
            pre = f"model.layers.{i}"
            h_in = h.copy()
            x = tamper(step, i, "self_attn.q_proj", "in", _norm(h))
            q = tamper(step, i, "self_attn.q_proj", "out", x @ W[f"{i}.q"])
            rec.add_call(f"{pre}.self_attn.q_proj", [x], [q])
            a = tamper(step, i, "self_attn.o_proj", "in", np.tanh(q) * 2)
            o = tamper(step, i, "self_attn.o_proj", "out", a @ W[f"{i}.o"])
            rec.add_call(f"{pre}.self_attn.o_proj", [a], [o])
            h = h + o
            x = tamper(step, i, "mlp.up_proj", "in", _norm(h))
            u = tamper(step, i, "mlp.up_proj", "out", x @ W[f"{i}.up"])
            rec.add_call(f"{pre}.mlp.up_proj", [x], [u])
            with np.errstate(all="ignore"):
                g = u * (1 / (1 + np.exp(-u)))
            g = tamper(step, i, "mlp.down_proj", "in", g)
            d = tamper(step, i, "mlp.down_proj", "out", g @ W[f"{i}.down"])
            rec.add_call(f"{pre}.mlp.down_proj", [g], [d])
            h = h + d
            h = tamper(step, i, "block", "out", h)
            rec.add_call(pre, [h_in], [h])
        with np.errstate(all="ignore"):
            logits = _norm(h) @ W["lm"]
        logits = tamper(step, -1, "root", "out", logits)
        rec.add_call("", [], [logits])
        call = rec.call
        nxt = token_override(step) if token_override else None
        if nxt is None:
            last = logits[-1]
            nxt = int(np.argmax(np.where(np.isnan(last), -np.inf, last)))
        batches.append(rec.batch(step, logits, step_ids, 1000.0 + step,
                                 logits_override(step) if logits_override else None))
        tokens = np.append(tokens, nxt)
    return batches


def write_trace(path: str, batches: list[StepBatch], n_layers: int, *, close: bool = True,
                environment: dict[str, Any] | None = None,
                status: dict[str, Any] | None = None) -> str:
    w = TraceWriter(path, modules=module_table(n_layers),
                    environment=environment or {"rank": 0, "world_size": 1},
                    capture_options={}, flush_interval=0.05)
    for b in batches:
        w.submit(b)
    if close:
        w.close(status)
    else:
        assert w.flush(), w.failed  # everything on disk before the caller simulates a kill
    return path


def make_trace(path: str, n_steps: int = 4, *, n_layers: int = 3, channels: int = 64,
               tamper: Tamper | None = None, close: bool = True, **kw: Any) -> str:
    model = TinyModel(n_layers=n_layers, channels=channels)
    env = kw.pop("environment", None)
    status = kw.pop("status", None)
    batches = run_model(model, n_steps, tamper=tamper, **kw)
    return write_trace(path, batches, n_layers, close=close, environment=env, status=status)
