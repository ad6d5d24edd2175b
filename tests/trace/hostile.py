"""Helpers for the hostile-trace tests: copies of the committed sample traces, mutated with h5py
or byte by byte, and a CLI runner that reports how a command ended."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
from click.testing import CliRunner

from qforensics.cli import main

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"
PASSING = "fp16-reference"  # the committed sample whose analysis PASSES
FAILING = "fp8-e4m3-nosat-act"  # the committed sample whose analysis FAILS at step 0


def sample(name: str) -> Path:
    p = SAMPLES / f"{name}.h5"
    assert p.is_file(), f"sample trace {p} missing (python sample_traces/regenerate.py)"
    return p


def copy(name: str, dst: Path) -> Path:
    out = dst / f"{name}-mutated.h5"
    shutil.copyfile(sample(name), out)
    return out


@dataclass
class Ran:
    code: int
    out: str
    err: str

    @property
    def first(self) -> str:
        return self.out.splitlines()[0] if self.out else ""


def run(*args: str) -> Ran:
    res = CliRunner().invoke(main, [str(a) for a in args])
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise AssertionError(f"exception escaped the CLI: {res.exception!r}")
    return Ran(res.exit_code, res.stdout, res.stderr)


def chunk_span(path: Path, dataset: str, index: int = 0) -> tuple[int, int]:
    """(file offset, size) of one stored chunk of `dataset`, from HDF5's own chunk index."""
    with h5py.File(path, "r") as f:
        info = f[dataset].id.get_chunk_info(index)
        return int(info.byte_offset), int(info.size)


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0xFF]))


def plain_column(path: Path, dataset: str) -> np.ndarray:
    with h5py.File(path, "r") as f:
        return f[dataset][:]
