"""Tiny synthetic traces for the report tests, written with the real TraceWriter.

`write_synthetic_trace` builds a small model-shaped trace: `n_layers` blocks of three linear
modules, `n_steps` steps, per-channel ranges for every record. With `fail=True` the down
projection of layer `bad_layer` receives two outlier channels (2,982 and 1,094, above FP8 e4m3's
448) at step 0 and outputs NaN, which then reaches every later module and the logits.
`names` overrides module names (e.g. hostile strings).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from qforensics.trace import schema
from qforensics.trace.writer import StepBatch, TraceWriter, set_meta

HIDDEN = 64
INNER = 128
OUTLIERS = {7: 2982.0, 41: 1094.0}  # channel of the bad module's input -> absmax


def bad_module_index(bad_layer: int = 1) -> int:
    """Index of the module that produces NaN (the down projection of `bad_layer`)."""
    return 4 * bad_layer + 2


def _modules(n_layers: int, names: list[str] | dict[int, str] | None) -> list[dict[str, str]]:
    mods = []
    for layer in range(n_layers):
        for part, kind in (("", "block"), (".mlp.up_proj", "quantized_linear"),
                           (".mlp.down_proj", "quantized_linear"), (".attn.o_proj", "linear")):
            quant = ({"bits": 8, "format": "fp8-e4m3-nosat", "target": "activations"}
                     if kind == "quantized_linear" else None)
            w = INNER if "down" in part else HIDDEN
            info = {"params": {} if kind == "block" else
                    {"weight": {"dtype": "float32", "shape": [HIDDEN, w]}},
                    "quant": quant,
                    "health": {} if kind == "block" else
                    {"weight": {"numel": HIDDEN * w, "nan": 0, "inf": 0, "zero": 3,
                                "subnormal": 0}}}
            mods.append({"name": f"model.layers.{layer}{part}", "type": "Linear" if kind != "block"
                         else "Block", "kind": kind, "info": json.dumps(info)})
    mods.append({"name": "lm_head", "type": "Linear", "kind": "linear",
                 "info": json.dumps({"params": {}, "quant": None, "health": {}})})
    if isinstance(names, dict):
        for i, n in names.items():
            mods[i % len(mods)]["name"] = n
    elif names:
        for i, n in enumerate(names):
            mods[i % len(mods)]["name"] = n
    return mods


def write_synthetic_trace(path: str | Path, *, n_layers: int = 4, n_steps: int = 6,
                          fail: bool = True, bad_layer: int = 1,
                          names: list[str] | dict[int, str] | None = None,
                          text: str | None = "Paris Paris Paris",
                          environment: dict | None = None, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    mods = _modules(n_layers, names)
    env = {"qforensics": "0.1.0", "torch": "2.13.0+cpu", "python": "3.11", "devices": ["cpu"],
           "fp8_cast": {"e4m3fn": "saturate", "e5m2": "inf"}, "argv": ["serve.py"],
           "scenario": "synthetic"}
    env.update(environment or {})
    w = TraceWriter(str(path), modules=mods, environment=env,
                    capture_options={"channel_io": "all"}, flush_interval=0.05)
    bad_mod = bad_module_index(bad_layer)
    call = 0
    for step in range(n_steps):
        recs, cmin_all, cmax_all, tok_all = [], [], [], []
        poisoned = False
        first_bad_call, first_bad_rec = -1, -1
        n_bad = 0
        tokens = 5 if step == 0 else 1
        for mid, m in enumerate(mods):
            width_in = INNER if mid % 4 == 2 and mid < 4 * n_layers else HIDDEN
            width_out = INNER if mid % 4 == 1 else HIDDEN
            for io, width in ((schema.IO_INPUT, width_in), (schema.IO_OUTPUT, width_out)):
                amax = np.abs(rng.normal(0.5, 0.2, width)).astype(np.float32) + 0.05
                if fail and step == 0 and mid == bad_mod and io == schema.IO_INPUT:
                    for ch, v in OUTLIERS.items():
                        amax[ch] = v
                nan = 0
                if fail and io == schema.IO_OUTPUT and (poisoned or (mid == bad_mod and step == 0)
                                                         or step > 0 and mid >= bad_mod):
                    nan = width * tokens
                    poisoned = True
                if fail and io == schema.IO_INPUT and poisoned:
                    nan = width * tokens
                r = np.zeros((), schema.record_dtype())
                r["call_index"], r["step"], r["module_id"], r["io"] = call, step, mid, io
                r["dtype"] = schema.DTYPE_CODES["float32"]
                r["numel"], r["rows"], r["channels"] = width * tokens, tokens, width
                r["min"], r["max"] = -float(amax.max()), float(amax.max())
                r["mean"], r["std"], r["absmax"] = 0.0, 0.3, float(amax.max())
                r["nan_count"] = nan
                r["chan_offset"] = sum(len(c) for c in cmin_all)
                r["tok_offset"] = sum(len(t) for t in tok_all)
                r["tok_count"] = tokens
                if nan and first_bad_rec < 0:
                    first_bad_rec = len(recs)
                    first_bad_call = call
                n_bad += bool(nan)
                recs.append(r)
                cmin_all.append(-amax)
                cmax_all.append(amax)
                tok_all.append(np.full(tokens, amax.max(), np.float32))
            call += 1
        st = np.zeros(1, schema.step_dtype())
        st["step"], st["t_start"], st["duration"], st["complete"] = step, 1.7e9 + step, 0.01, 1
        st["record_offset"], st["record_count"] = 0, len(recs)
        st["first_call"], st["n_calls"] = call - len(mods), len(mods)
        st["first_nonfinite_call"] = first_bad_call
        st["first_nonfinite_record"] = first_bad_rec
        st["n_nonfinite_records"] = n_bad
        st["token_offset"], st["token_count"] = 0, tokens
        st["has_logits"] = 1
        if fail:
            st["logits_min"] = st["logits_max"] = st["logits_mean"] = np.nan
            st["logits_nan"] = 1000
        else:
            st["logits_min"], st["logits_max"], st["logits_mean"] = -10 - step, 20 + step, 0.5
        st["logits_std"], st["logits_entropy"] = 3.0, 2.0
        st["logits_argmax"] = 11
        w.submit(StepBatch(steps=st, records=np.array(recs, schema.record_dtype()),
                           chan_min=np.concatenate(cmin_all), chan_max=np.concatenate(cmax_all),
                           tok_absmax=np.concatenate(tok_all),
                           input_ids=np.arange(tokens, dtype=np.int64)))
    w.close({"state": "complete", "steps": n_steps})
    if text is not None:
        set_meta(str(path), "outcome", {"text": text, "reference_text": "The capital is Paris.",
                                        "top1_agreement": 0.25, "prompt": "Capital of France?"})
    return Path(path)
