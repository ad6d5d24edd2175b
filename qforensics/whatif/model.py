"""The model what-if runs on: the user's own, checked against the trace before anything runs.

``--model`` takes an HF folder (a directory with config.json), a GGUF file (loaded through
transformers' ``gguf_file=``), or ``module:factory`` (a Python module or .py file and a
callable returning a model or ``(model, tokenizer)``). Without it, the model path the trace
recorded (``environment.model_path``: the HF folder or GGUF file capture saw the model loaded
from, vLLM's ``model=``, or ``demo``) is used, validated as untrusted input (an existing
absolute path or "demo"; a factory named by a trace is never imported); a trace without one is
refused (exit 2) unless the demo scenarios wrote it. In every case the model must match the
trace: same class, vocab size, module names and parameter shapes of the hooked modules (a vLLM
trace's fused layers are matched through the HF names it recorded). A mismatch is a
`UsageError` (exit 2) that says what differs; what-if never quietly measures a model the trace
is not of.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qforensics.errors import ModelNotAvailableError, UsageError

__all__ = ["ModelSource", "describe_mismatch", "load_demo", "load_model_source",
           "resolve_model_source"]

log = logging.getLogger(__name__)

DEMO = "demo"


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "hf" | "gguf" | "factory" | "demo"
    value: str
    origin: str  # where the choice came from: "--model", "the trace's metadata", "default"

    def describe(self) -> str:
        what = {"hf": "HF folder", "gguf": "GGUF file", "factory": "factory",
                "given": "the model", "demo": "the demo model (SmolLM2-135M-Instruct)"
                }[self.kind]
        return what if self.kind == DEMO else f"{what} {self.value} ({self.origin})"


def _classify(spec: str, origin: str) -> ModelSource:
    p = Path(spec).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise UsageError(f"--model {spec}: the folder has no config.json (an HF model "
                             "folder, as written by save_pretrained, is expected)")
        return ModelSource("hf", str(p), origin)
    if p.suffix.lower() == ".gguf":
        if not p.is_file():
            raise UsageError(f"--model {spec}: no such GGUF file")
        return ModelSource("gguf", str(p), origin)
    mod, sep, fn = spec.rpartition(":")
    if sep and mod and fn.isidentifier() and not p.exists():
        return ModelSource("factory", spec, origin)
    raise UsageError(f"--model {spec}: not an HF folder, a .gguf file or module:factory "
                     "(e.g. --model ./my-model, --model model.gguf, --model mypkg.models:build)")


def recorded_model_path(meta: dict[str, Any]) -> str | None:
    """The model path the trace recorded (``environment.model_path``), as stored: untrusted."""
    env = meta.get("environment") if isinstance(meta, dict) else None
    path = env.get("model_path") if isinstance(env, dict) else None
    return path if isinstance(path, str) and path.strip() else None


def _demo_scenario(meta: dict[str, Any]) -> str | None:
    """The demo scenario a trace without a model path was recorded by (traces the demo wrote
    before it recorded ``model_path: demo``), else None."""
    env = meta.get("environment") if isinstance(meta, dict) else None
    name = env.get("scenario") if isinstance(env, dict) else None
    if not isinstance(name, str):
        return None
    from qforensics.demo.scenarios import SCENARIOS

    return name if name in SCENARIOS else None


_MAX_PATH = 4096


def _from_trace(recorded: str) -> ModelSource:
    """The recorded model path, validated as untrusted input: an absolute path to an existing
    HF folder or .gguf file, or "demo". Never a factory: code named by a trace is not imported."""
    origin = "the trace's metadata"
    shown = recorded[:200] + ("..." if len(recorded) > 200 else "")
    if recorded == DEMO:
        return ModelSource(DEMO, DEMO, origin)
    if len(recorded) > _MAX_PATH or any(ord(c) < 32 for c in recorded):
        raise UsageError("the trace's model path is malformed (control characters or longer "
                         f"than {_MAX_PATH}); pass --model PATH")
    p = Path(recorded)
    if not p.exists():
        mod, sep, fn = recorded.rpartition(":")
        if sep and mod and fn.isidentifier():
            raise UsageError(f"the trace names a model factory ({shown}); what-if never imports "
                             "code a trace names: pass --model yourself if you trust it")
        raise UsageError(f"the trace was recorded from {shown}, which is not here (anymore); "
                         "pass --model PATH (an HF folder, a .gguf file or module:factory)")
    if not p.is_absolute():
        raise UsageError(f"the trace's model path {shown} is relative: it would depend on the "
                         "current folder; pass --model PATH")
    if p.is_dir() and (p / "config.json").is_file():
        return ModelSource("hf", str(p), origin)
    if p.is_file() and p.suffix.lower() == ".gguf":
        return ModelSource("gguf", str(p), origin)
    raise UsageError(f"the trace's model path {shown} is neither an HF folder (config.json) nor "
                     "a .gguf file; pass --model PATH")


def resolve_model_source(model: str | None, meta: dict[str, Any] | None) -> ModelSource:
    """Which model to run: ``--model``; else the path the trace recorded (validated, never
    imported); else, for a trace the demo scenarios wrote before they recorded a path, the demo
    model. A trace with no usable model path is a `UsageError` (exit 2)."""
    if model:
        return ModelSource(DEMO, DEMO, "--model") if model == DEMO else _classify(model, "--model")
    recorded = recorded_model_path(meta or {})
    if recorded is not None:
        return _from_trace(recorded)
    scenario = _demo_scenario(meta or {})
    if scenario is not None:
        return ModelSource(DEMO, DEMO, f"the trace's demo scenario {scenario!r}")
    raise UsageError("the trace records no model path (its program did not load the model from "
                     "a folder or a GGUF file); pass --model PATH (an HF folder, a .gguf file, "
                     "module:factory) or --model demo")


def _factory(spec: str) -> Any:
    mod_name, _, fn_name = spec.rpartition(":")
    try:
        if mod_name.endswith(".py"):
            path = Path(mod_name).expanduser().resolve()
            loader_spec = importlib.util.spec_from_file_location(path.stem, path)
            if loader_spec is None or loader_spec.loader is None:
                raise ImportError(f"cannot load {path}")
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
    except Exception as exc:
        raise UsageError(f"--model {spec}: cannot import {mod_name} ({type(exc).__name__}: "
                         f"{exc})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise UsageError(f"--model {spec}: {mod_name} has no callable {fn_name}")
    return fn()


_DEMO: tuple[Any, Any] | None = None


def load_demo() -> tuple[Any, Any]:
    """(model, tokenizer) of the demo model, loaded once per process (qforensics.demo.model)."""
    global _DEMO
    if _DEMO is None:
        from qforensics.demo.model import load_model

        _DEMO = load_model()
    return _DEMO


def load_model_source(src: ModelSource) -> tuple[Any, Any]:
    """(model in eval mode, tokenizer) for ``src``. Offline: nothing is fetched from a hub."""
    if src.kind == DEMO:
        return load_demo()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if src.kind == "factory":
        got = _factory(src.value)
        model, tok = got if isinstance(got, tuple) and len(got) == 2 else (got, None)
    else:
        if src.kind == "gguf":
            from qforensics.demo.model import gguf_path

            try:
                if Path(src.value).resolve() == gguf_path().resolve():
                    return load_demo()  # the demo's GGUF: its cached conversion
            except ModelNotAvailableError:
                pass
        from transformers import AutoModelForCausalLM, AutoTokenizer

        where, kw = (src.value, {}) if src.kind == "hf" else (
            str(Path(src.value).parent), {"gguf_file": Path(src.value).name})
        try:
            model = AutoModelForCausalLM.from_pretrained(where, local_files_only=True, **kw)
            tok = AutoTokenizer.from_pretrained(where, local_files_only=True, **kw)
        except Exception as exc:
            raise UsageError(f"cannot load {src.describe()}: {type(exc).__name__}: "
                             f"{str(exc)[:300]}") from None
    if not hasattr(model, "named_modules") or not callable(model):
        raise UsageError(f"{src.describe()} did not give a torch model "
                         f"(got {type(model).__name__})")
    if tok is None:
        raise UsageError(f"{src.describe()} gave no tokenizer: a factory must return "
                         "(model, tokenizer); what-if decodes answers and tokenizes its text")
    model.eval()
    return model, tok


def _vocab_size(model: Any) -> int | None:
    try:
        emb = model.get_output_embeddings()
        if emb is not None and getattr(emb, "weight", None) is not None:
            return int(emb.weight.shape[0])
    except Exception:
        pass
    v = getattr(getattr(model, "config", None), "vocab_size", None)
    return int(v) if isinstance(v, int) else None


def _trace_vocab(trace: Any, env: dict[str, Any]) -> int | None:
    v = env.get("vocab_size")
    if isinstance(v, int):
        return v
    mods = trace.modules
    for mid, name in mods["name"].items():
        if name.split(".")[-1] in ("lm_head", "embed_out", "output"):
            shape = trace.module_info(int(mid)).get("params", {}).get("weight", {}).get("shape")
            if isinstance(shape, list) and len(shape) == 2:
                return int(shape[0])
    return None


def describe_mismatch(trace: Any, model: Any) -> list[str]:
    """What differs between the model the trace recorded and ``model`` (empty: they match).
    Compares the class, the vocab size, the hooked modules' names and their parameter shapes."""
    meta = trace.meta
    env = meta.get("environment") if isinstance(meta.get("environment"), dict) else {}
    diffs: list[str] = []
    tclass = env.get("model_class")
    if isinstance(tclass, str) and tclass != type(model).__name__:
        diffs.append(f"class: the trace is of {tclass}, the model is {type(model).__name__}")
    tv, mv = _trace_vocab(trace, env), _vocab_size(model)
    if tv is not None and mv is not None and tv != mv:
        diffs.append(f"vocab size: {tv} in the trace, {mv} in the model")
    named = dict(model.named_modules())
    missing, shapes = [], []
    mods = trace.modules
    engine = env.get("engine") if isinstance(env.get("engine"), dict) else {}
    fused = engine.get("hf_names") if isinstance(engine.get("hf_names"), dict) else {}
    for mid, name in mods["name"].items():
        if not name:
            continue  # the root
        parts = fused.get(name)
        if isinstance(parts, list) and parts and all(isinstance(x, str) for x in parts):
            # a vLLM fused layer (qkv_proj, gate_up_proj): the HF layers it holds must exist;
            # its shapes are the concatenation, not theirs
            missing.extend(x for x in parts if x not in named)
            continue
        mod = named.get(name)
        if mod is None:
            missing.append(name)
            continue
        params = trace.module_info(int(mid)).get("params", {})
        for pname, spec in params.items() if isinstance(params, dict) else ():
            want = spec.get("shape") if isinstance(spec, dict) else None
            have = getattr(mod, pname, None)
            if isinstance(want, list) and hasattr(have, "shape") and \
                    list(have.shape) != [int(x) for x in want]:
                shapes.append(f"{name}.{pname} {want} vs {list(have.shape)}")
    n = max(1, int((mods["name"] != "").sum()))
    if missing:
        diffs.append(f"module names: {len(missing)} of {n} traced modules are not in the model "
                     f"(e.g. {', '.join(missing[:3])})")
    if shapes:
        diffs.append(f"shapes: {len(shapes)} parameters differ, trace vs model "
                     f"(e.g. {'; '.join(shapes[:3])})")
    return diffs


def check_model_matches(trace_path: str, model: Any, src: ModelSource) -> None:
    from qforensics.trace.reader import open_trace

    with open_trace(trace_path) as t:
        diffs = describe_mismatch(t, model)
    if diffs:
        raise UsageError(f"{trace_path} is not a trace of {src.describe()}: "
                         + "; ".join(diffs) + ". Pass --model with the model the trace was "
                         "recorded from")
    log.debug("model matches %s", json.dumps({"trace": trace_path, "model": src.value}))
