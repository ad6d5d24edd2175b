"""What the capture records about the process it runs in: versions, device, dtypes, the FP8 cast
behaviour of this torch, command line, host, rank."""

from __future__ import annotations

import os
import platform
import socket
import sys
from typing import Any

import torch
from torch import nn

from qforensics.version import __version__


def probe_fp8_cast() -> dict[str, Any]:
    """What an eager cast of out-of-range float32 values to float8 does in this torch."""
    out: dict[str, Any] = {"torch": torch.__version__}
    for name, attr, probe in (("e4m3fn", "float8_e4m3fn", 1000.0), ("e5m2", "float8_e5m2", 1e6)):
        dt = getattr(torch, attr, None)
        if dt is None:
            out[name] = "unsupported"
            continue
        try:
            v = torch.tensor([probe, -probe], dtype=torch.float32).to(dt).float().tolist()
            maxv = float(torch.finfo(dt).max)
            if all(x != x for x in v):
                out[name] = "nan"
            elif v == [maxv, -maxv]:
                out[name] = "saturate"
            elif all(abs(x) == float("inf") for x in v):
                out[name] = "inf"
            else:
                out[name] = f"other:{v}"
        except Exception as exc:  # pragma: no cover - depends on the torch build
            out[name] = f"unsupported:{type(exc).__name__}"
        out[f"{name}_probe_value"] = probe
    return out


def _version(mod: str) -> str | None:
    try:
        m = __import__(mod)
        return str(getattr(m, "__version__", "unknown"))
    except Exception:
        return None


def _model_path(model: nn.Module) -> str | None:
    """Where the model was loaded from: the GGUF file (transformers' ``gguf_file=``, kept in
    ``config.quantization_config.gguf_file`` beside ``_name_or_path``), else the local HF
    folder (config.json in it), as an absolute path; None when neither is known."""
    cfg = getattr(model, "config", None)
    p = getattr(cfg, "_name_or_path", None)
    qc = getattr(cfg, "quantization_config", None)
    gguf = qc.get("gguf_file") if isinstance(qc, dict) else getattr(qc, "gguf_file", None)
    if isinstance(gguf, str) and gguf:
        for cand in (gguf, os.path.join(p, gguf) if isinstance(p, str) and p else None):
            if cand and cand.lower().endswith(".gguf") and os.path.isfile(cand):
                return os.path.abspath(cand)
    if isinstance(p, str) and p and os.path.isfile(os.path.join(p, "config.json")):
        return os.path.abspath(p)
    return None


def _vocab_size(model: nn.Module) -> int | None:
    v = getattr(getattr(model, "config", None), "vocab_size", None)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def describe_environment(model: nn.Module, rank: int, world_size: int) -> dict[str, Any]:
    devices: set[str] = set()
    dtypes: set[str] = set()
    for p in list(model.parameters())[:2000]:
        devices.add(str(p.device))
        dtypes.add(str(p.dtype).replace("torch.", ""))
    cuda: dict[str, Any] = {"available": torch.cuda.is_available(), "version": torch.version.cuda}
    if torch.cuda.is_available():
        try:
            cuda["device_name"] = torch.cuda.get_device_name(0)
            cuda["capability"] = list(torch.cuda.get_device_capability(0))
        except Exception:
            pass
    compiled = type(model).__name__ == "OptimizedModule" or hasattr(model, "_orig_mod")
    return {
        "qforensics": __version__,
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "cuda": cuda,
        "devices": sorted(devices),
        "dtypes": sorted(dtypes),
        "compiled": bool(compiled),
        "model_class": type(model).__name__,
        "model_path": _model_path(model),
        "vocab_size": _vocab_size(model),
        "fp8_cast": probe_fp8_cast(),
        "argv": list(sys.argv),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "rank": rank,
        "world_size": world_size,
        "platform": platform.platform(),
    }


def rank_and_world() -> tuple[int, int]:
    def env_int(*names: str, default: int) -> int:
        for n in names:
            v = os.environ.get(n)
            if v is not None and v.strip().lstrip("-").isdigit():
                return int(v)
        return default

    return env_int("RANK", "LOCAL_RANK", "SLURM_PROCID", default=0), env_int(
        "WORLD_SIZE", "SLURM_NTASKS", default=1)
