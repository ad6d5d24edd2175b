"""A synthetic fleet of traces written with the project's TraceWriter (no torch), for the triage
tests and bench/triage_fleet.py.

Each trace is one rank of one run of a Llama-shaped decoder: per layer the HF linears
(q/k/v/o_proj, gate/up/down_proj) or vLLM's fused ones (qkv_proj, o_proj, gate_up_proj,
down_proj), the block, and the root (the logits). Step 0 is the prefill of `prompt` tokens with
per-channel ranges, then one token per step. Statistics are drawn per record the way capture
reduces them (finite-only min/max/absmax, per-channel ranges, per-token absmax), and an
incident changes them the way the failure would:

  weight_nan      one NaN in row `row` of the producer's weight (module info health); its output
                  and everything after it hold NaN from step 0
  scale_nan       vLLM: a NaN in `weight_scale` row `row` of a fused layer (TP rank 0); the
                  other ranks see NaN only after the row-parallel all-reduce of o_proj
  fp8_outlier     FP8 e4m3 activations at down_proj, input channel `channel` at 3,000 (> 448)
  fp16_overflow   float16 compute, finite input, Inf out of the producer
  gap             the NaN appears first in down_proj's input (an unhooked activation op)
  zero_weights    no NaN; the producer's and later layers' weights are mostly exact zeros
  None            healthy

`Spec.expect()` says what triage must find for the trace, from how it was built.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qforensics.trace import schema
from qforensics.trace.writer import StepBatch, TraceWriter

HF = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
VLLM = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
SHAPES = {  # name -> (layers, hidden, intermediate)
    "llama-160m": (12, 768, 2048),
    "smollm2-135m": (30, 576, 1536),
    "qwen2.5-0.5b-4l": (4, 896, 4864),
}
VOCAB = 4096
MAX_BYTES = 64 << 20  # the capture's byte budget (sizes the fixed /summary region)


@dataclass
class Spec:
    path: str
    engine: str = "hf"  # "hf" | "vllm"
    version: str = "4.57.1"
    torch: str = "2.8.0+cu128"
    model: str = "/models/llama-160m"
    shape: str = "llama-160m"
    prompt: int = 32
    steps: int = 6
    rank: int = 0
    world: int = 1
    host: str = "replica-0"
    incident: str | None = None
    layer: int = 3
    row: int = 100
    channel: int = 517
    t0: float = 1.79e9
    seed: int = 0
    quant: str | None = None  # a recorded quant format for every linear
    extra_env: dict[str, Any] = field(default_factory=dict)

    def names(self) -> tuple[str, ...]:
        return VLLM if self.engine == "vllm" else HF

    def producer_leaf(self) -> str:
        return {"weight_nan": "self_attn.o_proj", "scale_nan": "self_attn.qkv_proj",
                "fp8_outlier": "mlp.down_proj", "fp16_overflow": "mlp.up_proj"
                if self.engine == "hf" else "mlp.gate_up_proj", "gap": "mlp.down_proj",
                "zero_weights": "mlp.down_proj"}[self.incident or ""]


def _widths(leaf: str, hidden: int, inter: int) -> tuple[int, int]:
    kv = hidden // 4
    return {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "qkv_proj": (hidden, hidden + 2 * kv), "o_proj": (hidden, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "gate_up_proj": (hidden, 2 * inter), "down_proj": (inter, hidden)}[leaf]


def _modules(spec: Spec) -> tuple[list[dict[str, str]], list[tuple[str, int, int]]]:
    layers, hidden, inter = SHAPES[spec.shape]
    mods, calls = [], []
    for i in range(layers):
        for lin in spec.names():
            name = f"model.layers.{i}.{lin}"
            win, wout = _widths(lin.rsplit(".", 1)[1], hidden, inter)
            info: dict[str, Any] = {"params": {"weight": {"shape": [wout, win],
                                                          "dtype": "bfloat16"}},
                                    "quant": None, "health": {"weight": {
                                        "numel": win * wout, "nan": 0, "inf": 0,
                                        "zero": win * wout // 500, "subnormal": 0}}}
            if spec.quant:
                info["quant"] = {"format": spec.quant, "bits": 8, "target": "weights"}
            _corrupt(spec, i, lin, info, win, wout)
            mods.append({"name": name, "type": "QKVParallelLinear" if "qkv" in lin else (
                "Linear" if spec.engine == "hf" else "LinearBase"), "kind": "linear",
                "info": json.dumps(info)})
            calls.append((name, win, wout))
        mods.append({"name": f"model.layers.{i}", "type": "LlamaDecoderLayer", "kind": "block",
                     "info": "{}"})
        calls.append((f"model.layers.{i}", hidden, hidden))
    mods.append({"name": "", "type": "LlamaForCausalLM", "kind": "root", "info": "{}"})
    calls.append(("", hidden, VOCAB))
    return mods, calls


def _corrupt(spec: Spec, layer: int, lin: str, info: dict, win: int, wout: int) -> None:
    if spec.incident is None or lin != spec.producer_leaf():
        return
    h = info["health"]["weight"]
    if spec.incident == "weight_nan" and layer == spec.layer:
        h.update(nan=1, first_nonfinite={"index": spec.row * win + 7, "row": spec.row,
                                         "col": 7})
    elif spec.incident == "scale_nan" and layer == spec.layer and spec.rank == 0:
        info["health"]["weight_scale"] = {"numel": wout, "nan": 1, "inf": 0, "zero": 0,
                                          "subnormal": 0, "first_nonfinite": {
                                              "index": spec.row, "row": spec.row}}
    elif spec.incident == "fp8_outlier":
        info["quant"] = {"format": "fp8-e4m3", "bits": 8, "target": "activations"}
    elif spec.incident == "zero_weights" and layer >= spec.layer:
        h["zero"] = int(win * wout * 0.97)


def _bad_call(spec: Spec, name: str, layer: int, step: int) -> str | None:
    """'out' when this call's output first holds NaN/Inf, 'in' for its input, 'both' after."""
    inc = spec.incident
    if inc in (None, "zero_weights"):
        return None
    if step > 0:
        return "both"
    leaf = spec.producer_leaf()
    if inc == "scale_nan" and spec.rank > 0:
        leaf = "self_attn.o_proj"  # the all-reduce inside the row-parallel o_proj
    target = f"model.layers.{spec.layer}.{leaf}"
    if name == target:
        return "in" if inc == "gap" else "out"
    order = _order(spec)
    return "both" if order.index(name) > order.index(target) else None


_ORDERS: dict[tuple, list[str]] = {}


def _order(spec: Spec) -> list[str]:
    key = (spec.shape, spec.engine)
    if key not in _ORDERS:
        _ORDERS[key] = [c[0] for c in _modules(Spec(path="", shape=spec.shape,
                                                    engine=spec.engine))[1]]
    return _ORDERS[key]


def _step(spec: Spec, step: int, calls: list, ids: dict[str, int], first_call: int,
          rng: np.random.Generator) -> StepBatch:
    rows = spec.prompt if step == 0 else 1
    keep_chan = step == 0
    n = 2 * len(calls)
    rec = np.zeros(n, schema.record_dtype())
    cmins, cmaxs, toks = [], [], []
    chan_off = tok_off = 0
    dtype = schema.DTYPE_CODES["float16" if spec.incident == "fp16_overflow" else "bfloat16"]
    for c, (name, win, wout) in enumerate(calls):
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        bad = _bad_call(spec, name, layer, step)
        for io, width in ((0, win), (1, wout)):
            k = 2 * c + io
            r = rec[k]
            r["call_index"], r["step"], r["module_id"], r["io"], r["slot"] = (
                first_call + c, step, ids[name], io, 0)
            r["dtype"], r["rows"], r["channels"], r["numel"] = dtype, rows, width, rows * width
            scale = 1.0 + 0.3 * rng.random()
            a = np.abs(rng.standard_normal(width)).astype(np.float32) * scale + 0.5 * scale
            if (spec.incident == "fp8_outlier" and io == 0 and name ==
                    f"model.layers.{spec.layer}.mlp.down_proj"):
                a[spec.channel] = 3000.0
            nonfinite = bad in ("both", "in") or (bad == "out" and io == 1)
            if nonfinite and spec.incident == "fp16_overflow" and bad == "out":
                r["inf_count"] = rows * 3
            elif nonfinite:
                r["nan_count"] = rows * width if bad == "both" else rows * 2
            r["min"], r["max"] = -float(a.max()) * 0.9, float(a.max())
            r["absmax"] = float(a.max())
            r["mean"], r["std"] = 0.01, scale * 0.8
            r["tok_offset"], r["tok_count"] = tok_off, rows
            t = (a.max() * (0.6 + 0.4 * rng.random(rows))).astype(np.float32)
            toks.append(t)
            tok_off += rows
            if keep_chan and name != "":
                r["chan_offset"] = chan_off
                cmins.append(-a * 0.9)
                cmaxs.append(a)
                chan_off += width
            else:
                r["chan_offset"] = -1
    s = np.zeros(1, schema.step_dtype())
    s["step"], s["t_start"], s["duration"], s["complete"] = step, spec.t0 + step, 0.02, 1
    s["record_count"], s["first_call"], s["n_calls"], s["token_count"] = (
        n, first_call, len(calls), rows)
    bad_rec = (rec["nan_count"] + rec["inf_count"]) > 0
    s["n_nonfinite_records"] = int(bad_rec.sum())
    s["first_nonfinite_record"] = int(np.argmax(bad_rec)) if bad_rec.any() else -1
    ob = bad_rec & (rec["io"] == 1)
    s["first_nonfinite_call"] = int(rec["call_index"][np.argmax(ob)]) if ob.any() else -1
    s["has_logits"] = 1
    logits_bad = bool(bad_rec[-1])
    if logits_bad:
        for f in ("logits_min", "logits_max", "logits_mean", "logits_std", "logits_entropy"):
            s[f] = np.nan
        s["logits_nan"], s["logits_argmax"] = VOCAB, -1
    else:
        s["logits_min"], s["logits_max"] = -12.0 - rng.random(), 18.0 + rng.random()
        s["logits_mean"], s["logits_std"] = 0.1, 2.5
        s["logits_entropy"] = 2.0 + rng.random()
        s["logits_argmax"] = int(rng.integers(1, VOCAB))
        s["logits_top5_ids"] = rng.integers(1, VOCAB, 5)
        s["logits_top5_values"] = np.sort(rng.random(5))[::-1] + 17.0
    return StepBatch(steps=s, records=rec,
                     chan_min=np.concatenate(cmins or [np.zeros(0)]).astype(np.float16),
                     chan_max=np.concatenate(cmaxs or [np.zeros(0)]).astype(np.float16),
                     tok_absmax=np.concatenate(toks).astype(np.float32),
                     input_ids=rng.integers(1, VOCAB, rows).astype(np.int64))


def environment(spec: Spec) -> dict[str, Any]:
    env: dict[str, Any] = {"rank": spec.rank, "world_size": spec.world, "host": spec.host,
                           "torch": spec.torch, "python": "3.11.7", "qforensics": "0.1.0",
                           "model_class": "LlamaForCausalLM", "model_path": spec.model,
                           "dtypes": ["float16" if spec.incident == "fp16_overflow"
                                      else "bfloat16"], "devices": ["cuda:0"],
                           "compiled": False, **spec.extra_env}
    if spec.engine == "vllm":
        layers = SHAPES[spec.shape][0]
        fused = {f"model.layers.{i}.{lin}": [f"model.layers.{i}.{lin.rsplit('.', 1)[0]}.{p}"
                                             for p in parts]
                 for i in range(layers) for lin, parts in (
                     ("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
                     ("mlp.gate_up_proj", ("gate_proj", "up_proj")))}
        env["engine"] = {"name": "vllm", "version": spec.version, "tp_rank": spec.rank,
                         "tp_size": spec.world, "pp_rank": 0, "pp_size": 1,
                         "rank": spec.rank, "ranks": spec.world, "hf_names": fused,
                         "quant_methods": {f"model.layers.{i}.{lin}": "Fp8LinearMethod"
                                           for i in range(layers) for lin in VLLM},
                         "quantization": "fp8"}
    else:
        env["transformers"] = spec.version
    return env


def write_trace(spec: Spec) -> str:
    mods, calls = _modules(spec)
    ids = {m["name"]: i for i, m in enumerate(mods)}
    rng = np.random.default_rng(spec.seed)
    w = TraceWriter(spec.path, modules=mods, environment=environment(spec),
                    capture_options={"channel_dtype": "float16", "channel_steps": "0",
                                     "max_bytes": MAX_BYTES},
                    channel_dtype="float16", flush_interval=30.0, max_bytes=MAX_BYTES)
    call = 0
    for step in range(spec.steps):
        w.submit(_step(spec, step, calls, ids, call, rng))
        call += len(calls)
    w.close({"state": "complete"})
    return spec.path


def expect(spec: Spec) -> dict[str, Any]:
    """What triage must report for this trace, from how it was built: verdict, producer in
    HF spelling, cause kind and index."""
    inc = spec.incident
    if inc is None:
        return {"verdict": "PASSED"}
    leaf = spec.producer_leaf()
    base = f"model.layers.{spec.layer}."
    hf = {"self_attn.qkv_proj": "self_attn.q_proj+k_proj+v_proj",
          "mlp.gate_up_proj": "mlp.gate_proj+up_proj"}
    if inc == "zero_weights":
        return {"verdict": "SUSPECT", "cause": "parameters_mostly_zero"}
    if inc == "scale_nan" and spec.rank > 0:
        return {"verdict": "FAILED", "producer": base + "self_attn.o_proj"}
    out = {"verdict": "FAILED", "producer": base + hf.get(leaf, leaf)}
    out.update({"weight_nan": {"cause": "corrupted_parameters",
                               "cause_index": f"weight row {spec.row}"},
                "scale_nan": {"cause": "corrupted_parameters",
                              "cause_index": f"weight_scale row {spec.row}"},
                "fp8_outlier": {"cause": "activation_outlier",
                                "cause_index": f"channels {spec.channel}"},
                "fp16_overflow": {"cause": "compute_overflow", "cause_index": "fp16"},
                "gap": {"cause": "unhooked_op", "cause_index": ""}}[inc])
    return out


# -- fleets ----------------------------------------------------------------------------------------
def hostile_files(d: str) -> dict[str, str]:
    """Unreadable traces, by kind: path. A valid trace is written first to cut and link."""
    import os
    import shutil

    import h5py

    os.makedirs(d, exist_ok=True)
    good = write_trace(Spec(os.path.join(d, "source.tmp"), shape="qwen2.5-0.5b-4l"))
    out = {k: os.path.join(d, f"{k}.h5") for k in ("garbage", "empty", "truncated", "extlink")}
    with open(out["garbage"], "wb") as fh:
        fh.write(np.random.default_rng(5).bytes(4096))
    open(out["empty"], "wb").close()
    with open(good, "rb") as fh:
        data = fh.read()
    with open(out["truncated"], "wb") as fh:
        fh.write(data[: len(data) // 3])
    shutil.copyfile(good, out["extlink"])
    with h5py.File(out["extlink"], "r+") as f:
        f["meta/elsewhere"] = h5py.ExternalLink("/etc/passwd", "/")
    os.remove(good)
    return out


def small_fleet(d: str) -> list[Spec]:
    """A fleet of 16 trace files with four incident groups (see the tests' expectations):
    a weight NaN on three HF replicas, an FP8 outlier on two vLLM 0.11.1 replicas with long
    prompts, a TP=2 vLLM run whose rank 0 holds a NaN scale (one incident, two files), a
    silent all-zero weight run; and eight healthy runs (HF and vLLM 0.11.0, short prompts)."""
    import os

    os.makedirs(d, exist_ok=True)
    specs = []
    t = 1.79e9
    for i in range(3):
        specs.append(Spec(os.path.join(d, f"hf-wnan-{i}.h5"), incident="weight_nan", layer=2,
                          row=77, host=f"replica-{i}", t0=t + 100 * i, seed=i, steps=3))
    for i in range(2):
        specs.append(Spec(os.path.join(d, f"vllm-fp8-{i}.h5"), engine="vllm", version="0.11.1",
                          incident="fp8_outlier", layer=5, channel=1234, prompt=600,
                          host=f"replica-{i + 3}", t0=t + 50 + i, seed=10 + i, steps=3))
    for r in range(2):
        specs.append(Spec(os.path.join(d, "tp", f"run7-{r}.h5"), engine="vllm",
                          version="0.11.0", incident="scale_nan", layer=4, row=33, world=2,
                          rank=r, host="replica-5", t0=t + 20, seed=20 + r, steps=3))
    specs.append(Spec(os.path.join(d, "hf-zero.h5"), incident="zero_weights", layer=6,
                      t0=t + 300, seed=30, steps=3))
    for i in range(8):
        vllm = i % 2 == 1
        specs.append(Spec(os.path.join(d, "healthy", f"ok-{i}.h5"),
                          engine="vllm" if vllm else "hf", version="0.11.0" if vllm else "4.57.1",
                          prompt=24 + i, host=f"replica-{i % 6}", t0=t + i, seed=40 + i,
                          steps=3))
    for s in specs:
        os.makedirs(os.path.dirname(s.path), exist_ok=True)
        write_trace(s)
    return specs
