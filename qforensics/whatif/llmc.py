"""What-if schemes calibrated by llmcompressor: ``llmc:GPTQ-PRESET[-g<N>]``, ``llmc:SQ-W8A8``.

llmcompressor (with the transformers release it pins) lives in a venv of its own
(scripts/install-llmc.sh: ``.venv-llmc``); what-if runs it as a subprocess
(`qforensics.whatif.llmc_worker`) on the model what-if measures, handed over as an HF folder of
float32 safetensors written here (so a GGUF-loaded model works too):

- ``llmc:GPTQ-W4A16-g64``: ``oneshot`` with ``GPTQModifier`` and compressed-tensors' preset
  (``-g<N>`` sets its group size, as for ``ct:``); ``llmc:GPTQ-W8A8`` likewise;
- ``llmc:SQ-W8A8``: ``SmoothQuantModifier`` (strength 0.8) then ``GPTQModifier`` W8A8,
  llmcompressor's own W8A8 recipe.

The specs are parsed with the other schemes (`qforensics.whatif.schemes.parse_llmc`).

Every Linear but lm_head is quantized, except (as for ``ct:``) those whose in_features the
group size does not divide. The calibration data is ``qforensics/data/calibration.txt``, a text
written for this purpose and distinct from the evaluation text (``perplexity.txt``): up to
`SAMPLES` consecutive windows of `SEQ_LEN` tokens. llmcompressor saves a compressed-tensors
checkpoint (``save_compressed=True``); it is kept in the cache (``llmc/`` under the cache root, qforensics/cachedir.py),
keyed by the model's weights, the scheme, the calibration text and the llmcompressor version, so
a second run does not calibrate again.

Measured like ``ct:``: **HF** from the checkpoint as this environment's transformers and
compressed-tensors load it, decompressed (the library's quantized forward: weights on the
calibrated grid, dynamic activation quantization for W8A8), in the model's dtype; **vLLM**
(``--engine vllm``) serving the very checkpoint (`qforensics.whatif.through_vllm`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from qforensics.errors import QForensicsError, UsageError

__all__ = ["LlmcError", "applied_llmc", "calibrate", "measure_llmc", "prepare_llmc",
           "resolve_llmc_python", "twin_ct", "with_twins"]

CALIBRATION_RESOURCE = "calibration.txt"
SAMPLES, SEQ_LEN = 16, 128
TIMEOUT_S = 3 * 3600
_CHECKED: set[str] = set()  # llmc Pythons where llmcompressor imported


class LlmcError(QForensicsError):
    """llmcompressor could not calibrate a scheme (its own words in the message)."""


def twin_ct(sc: Any) -> str:
    """The ``ct:`` spec of the same preset with min/max scales: what calibration is measured
    against."""
    return f"ct:{sc.preset}"


def with_twins(schemes: list[Any]) -> list[Any]:
    """``schemes`` with each llmc: scheme after its min/max ct: twin (added when not given)."""
    from qforensics.whatif.schemes import parse_whatif_scheme

    labels, out = {s.label for s in schemes}, []
    for s in schemes:
        if s.library == "llmcompressor" and twin_ct(s) not in labels:
            labels.add(twin_ct(s))
            out.append(parse_whatif_scheme(twin_ct(s)))
        out.append(s)
    return out


def resolve_llmc_python(given: str | None) -> str:
    """The Python of llmcompressor's venv: --llmc-python, else $QF_LLMC_PYTHON, else this
    checkout's .venv-llmc; checked by importing llmcompressor there (UsageError otherwise)."""
    repo = Path(__file__).resolve().parents[2]
    py = given or os.environ.get("QF_LLMC_PYTHON") or str(repo / ".venv-llmc" / "bin" / "python")
    p = shutil.which(py) or py
    if p in _CHECKED:
        return p
    if not os.path.isfile(p) or not os.access(p, os.X_OK):
        raise UsageError(f"llmc: schemes run llmcompressor in its own venv; {py} is not an "
                         "executable: run `bash scripts/install-llmc.sh` and pass "
                         "--llmc-python .venv-llmc/bin/python")
    try:
        r = subprocess.run([p, "-c", ("import llmcompressor, compressed_tensors, datasets; "
                                      "print(llmcompressor.__version__)")],
                           capture_output=True, text=True, timeout=300, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UsageError(f"--llmc-python {py}: cannot run it: {exc}") from None
    if r.returncode != 0:
        last = [ln for ln in r.stderr.splitlines() if ln.strip()][-1:] or ["no output"]
        raise UsageError(f"--llmc-python {py}: llmcompressor does not import there: {last[0]} "
                         "(scripts/install-llmc.sh builds a venv where it does)")
    _CHECKED.add(p)
    return p


def calibration_text() -> str:
    return resources.files("qforensics").joinpath("data", CALIBRATION_RESOURCE).read_text("utf-8")


def _model_digest(model: Any) -> str:
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().float().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:24]


def _ignored(model: Any, sc: Any) -> list[str]:
    """Linears (not lm_head) whose in_features the scheme's group size does not divide."""
    from torch import nn

    from qforensics.whatif.library import check_compressed_tensors_preset

    w = check_compressed_tensors_preset(sc.preset).weights  # -g<N> already applied
    if str(getattr(w.strategy, "value", w.strategy)) != "group":
        return []
    return [n for n, mod in model.named_modules() if isinstance(mod, nn.Linear)
            and not n.endswith("lm_head") and mod.in_features % int(w.group_size)]


def _write_base(model: Any, tokenizer: Any, dst: Path) -> Path:
    """The model as an HF folder of float32 safetensors llmcompressor's transformers loads."""
    from qforensics.demo.vllm_model import save_model_folder as _save_folder
    from qforensics.whatif.checkpoints import base_state

    sd, cfg = base_state(model)
    full = model.state_dict()
    cfg["torch_dtype"] = "float32"
    return _save_folder(dst, {k: full[k].detach().float().contiguous() for k in sd}, cfg,
                        tokenizer)


def cache_name(model: Any, sc: Any, python: str, text: str, samples: int, seq_len: int,
               ignore: list[str]) -> str:
    """The cache folder's name: the scheme, and a hash of everything the checkpoint depends on
    (the model's weights, the calibration text and window, the library's and worker's version)."""
    key = hashlib.sha256(json.dumps(
        [_model_digest(model), sc.label, sc.algo, hashlib.sha256(text.encode()).hexdigest(),
         samples, seq_len, ignore, _version(python),
         hashlib.sha256(Path(__file__).with_name("llmc_worker.py").read_bytes()).hexdigest()]
    ).encode()).hexdigest()[:20]
    return f"{re.sub(r'[^A-Za-z0-9_.-]+', '-', sc.label)}-{key}"


def _stream(pipe: Any, log: Any, label: str, say: Callable[[str], None]) -> None:
    """Copy the worker's output to ``log``; pass its own lines and each new layer on."""
    seen: set[str] = set()
    for raw in pipe:
        log.write(raw)
        for part in raw.replace("\r", "\n").splitlines():
            if part.startswith("llmc: "):
                say(f"{label}: {part[6:]}")
            hit = re.search(r"Quantizing \d+ module\(s\): \['([\w.]*?layers\.\d+)\.", part)
            if hit and hit.group(1) not in seen:
                seen.add(hit.group(1))
                say(f"{label}: calibrating {hit.group(1)}")


def calibrate(model: Any, tokenizer: Any, sc: Any, python: str, *,
              samples: int = SAMPLES, seq_len: int = SEQ_LEN, calib_text: str | None = None,
              ignore: list[str] | None = None, cache: Path | None = None,
              say: Callable[[str], None] = lambda m: None, timeout: float = TIMEOUT_S
              ) -> tuple[Path, dict[str, Any]]:
    """(the compressed-tensors checkpoint llmcompressor wrote for ``sc``, its llmc.json).
    ``ignore``: more Linears to leave alone (default: none). Raises `LlmcError`."""
    from qforensics.demo.model import cache_dir

    text = calib_text if calib_text is not None else calibration_text()
    ignore = sorted(set(_ignored(model, sc)) | set(ignore or []))
    root = cache if cache is not None else cache_dir() / "llmc"
    dst = root / cache_name(model, sc, python, text, samples, seq_len, ignore)
    if (dst / "llmc.json").is_file() and (dst / "config.json").is_file():
        say(f"{sc.label}: llmcompressor's checkpoint from an earlier run ({dst})")
        return dst, json.loads((dst / "llmc.json").read_text())
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="qforensics-llmc-") as tmp:
        work = Path(tmp)
        say(f"{sc.label}: handing the model to llmcompressor as float32 safetensors")
        base = _write_base(model, tokenizer, work / "base")
        (work / "calibration.txt").write_text(text, encoding="utf-8")
        out = work / "out"
        m = re.search(r"-g(\d+)$", sc.preset)
        cmd = [python, "-m", "qforensics.whatif.llmc_worker", str(base), str(out),
               "--algo", sc.algo, "--preset", re.sub(r"-g\d+$", "", sc.preset),
               "--calib", str(work / "calibration.txt"), "--samples", str(samples),
               "--seq-len", str(seq_len), "--ignore", *ignore]
        if m:
            cmd[cmd.index("--calib"):cmd.index("--calib")] = ["--group", m.group(1)]
        from qforensics.demo.vllm_scenarios import serve_env  # this checkout on PYTHONPATH
        from qforensics.lifeline import child_env
        from qforensics.whatif.vllm_engine import wait_group

        env = child_env({**serve_env(), "TOKENIZERS_PARALLELISM": "false"})
        log_path = work / "llmc.log"
        with open(log_path, "w") as log:
            # llmcompressor logs (loguru) to stdout, the worker's own lines go to stderr
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, errors="replace",
                                    start_new_session=True)
            reader = threading.Thread(target=_stream, args=(proc.stdout, log, sc.label, say),
                                      daemon=True)
            reader.start()
            try:
                rc = wait_group(proc, timeout)
            finally:
                reader.join(10)
        if rc is None:
            raise LlmcError(f"{sc.label}: llmcompressor did not finish within {timeout:.0f} s")
        if rc != 0 or not (out / "llmc.json").is_file():
            raise LlmcError(f"{sc.label}: llmcompressor failed (exit {rc}): "
                            f"{_root_cause(log_path.read_text(errors='replace'))}")
        shutil.rmtree(dst, ignore_errors=True)
        shutil.move(str(out), str(dst))
    return dst, json.loads((dst / "llmc.json").read_text())


def _version(python: str) -> str:
    r = subprocess.run([python, "-c", ("import importlib.metadata as m; print(m.version("
                                       "'llmcompressor'), m.version('compressed-tensors'))")],
                       capture_output=True, text=True, timeout=120, check=False)
    return r.stdout.strip()


def _root_cause(log: str) -> str:
    from qforensics.whatif.llmc_worker import ERROR_TAG
    from qforensics.whatif.vllm_engine import root_cause

    tagged = [ln for ln in log.splitlines() if ln.startswith(ERROR_TAG)]
    return tagged[-1][len(ERROR_TAG):] if tagged else root_cause(log)


def load_llmc_model(folder: Path, dtype: Any = None) -> Any:
    """The checkpoint as this environment's transformers + compressed-tensors load it: the
    library's quantized forward (weights decompressed on the first forward, dynamic activation
    quantization where the scheme has it), in ``dtype`` (default float32). Raises `LlmcError`."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype or torch.float32)
    except Exception as exc:  # noqa: BLE001 - the library's own words, per scheme
        raise LlmcError(f"{folder.name}: transformers / compressed-tensors cannot load "
                        f"llmcompressor's checkpoint: {type(exc).__name__}: {exc}") from None
    n = sum(getattr(m, "quantization_scheme", None) is not None for m in model.modules())
    if n == 0:
        raise LlmcError(f"{folder.name}: no Linear of the loaded checkpoint is quantized")
    return model.eval()


@contextlib.contextmanager
def applied_llmc(whatif: Any, folder: Path) -> Iterator[None]:
    """``whatif`` measures the llmcompressor checkpoint's model instead of its own for the
    duration (SmoothQuant changes norms too: the whole model is the checkpoint's)."""
    own = whatif.model
    whatif.model = load_llmc_model(folder, next(own.parameters()).dtype)  # as the model runs
    try:
        yield
    finally:
        whatif.model = own


def prepare_llmc(model: Any, tokenizer: Any, schemes: list[Any], python: str,
                 say: Callable[[str], None]) -> dict[str, tuple[Path | None, dict[str, Any]]]:
    """{label: (checkpoint folder, llmc.json) or (None, {"error": ...})} for each llmc: scheme;
    a scheme that fails does not stop the others."""
    out: dict[str, tuple[Path | None, dict[str, Any]]] = {}
    for sc in schemes:
        if sc.library != "llmcompressor" or sc.label in out:
            continue
        try:
            out[sc.label] = calibrate(model, tokenizer, sc, python, say=say)
        except LlmcError as exc:
            say(f"{sc.label}: not measured: {exc}")
            out[sc.label] = (None, {"error": str(exc)})
    return out


def measure_llmc(wi: Any, sc: Any, prepared: tuple[Path | None, dict[str, Any]],
                 say: Callable[[str], None]) -> Any:
    """The `SchemeResult` of an llmc: scheme on ``wi`` (a `WhatIf`), or one that says why it
    was not measured."""
    from qforensics.whatif.results import SchemeResult

    folder, info = prepared
    err = info.get("error") if folder is None else None
    if err is None:
        try:
            r = wi.measure(sc)
        except LlmcError as exc:
            err = str(exc)
        else:
            r.weights = (f"llmcompressor {' + '.join(info.get('modifiers', []))} "
                         f"{sc.preset}, calibrated on {info['calibration']['samples']} x "
                         f"{info['calibration']['seq_len']} tokens of "
                         f"{info['calibration']['file']}")
            r.library = info
            say(f"{r.scheme} (HF, llmcompressor's checkpoint): top-1 {100 * r.top1:.1f}%, KL "
                f"{r.kl:.4f}, ppl {r.ppl:.2f}, recovered {100 * r.recovered:.1f}% "
                f"[{r.seconds:.1f}s]")
            return r
    say(f"{sc.label}: not measured: {err}")
    nan = float("nan")
    return SchemeResult(sc.label, f"llmcompressor {sc.preset}", None, nan, nan, nan, nan, nan,
                        False, "", 0.0, error=err)
