"""GGUF tensors: float tensors checked for NaN/Inf, quantized blocks checked through their scales.

Reading uses `gguf.GGUFReader` (a numpy memmap). A quantized tensor is a run of fixed-size blocks;
each block starts (or ends) with half-float scale fields. The table `BLOCK_LAYOUTS` names them
with their byte offsets, from ggml's `block_q4_0` etc.:

    Q4_0  18 B: d, qs[16]            Q4_1  20 B: d, m, qs[16]       Q8_0  34 B: d, qs[32]
    Q5_0  22 B: d, qh[4], qs[16]     Q5_1  24 B: d, m, qh[4], qs[16]
    Q2_K  84 B: scales[16], qs[64], d, dmin      Q3_K 110 B: hmask[32], qs[64], scales[12], d
    Q4_K 144 B: d, dmin, scales[12], qs[128]     Q5_K 176 B: d, dmin, scales[12], qh[32], qs[128]
    Q6_K 210 B: ql[128], qh[64], scales[16], d

The blocks of a chunk are viewed as a [n_blocks, block_bytes] uint8 array and each field as a
strided float16 view of it: no copy, no Python loop over blocks. `d` (the multiplier) gets the
scale checks (NaN, Inf, zero, subnormal); `m`/`dmin` (offsets) only NaN and Inf, since 0 is an
ordinary minimum. Other block types are reported as not checked.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable

import numpy as np

from qforensics.errors import ScanError
from qforensics.scan.dtypes import FLOAT_FORMATS
from qforensics.scan.findings import FileSummary, Finding, Skipped
from qforensics.scan.values import Tally, findings_from_tallies, tally_float_chunks, tally_mask

__all__ = ["BlockField", "BLOCK_LAYOUTS", "open_gguf", "scan_gguf"]


@dataclass(frozen=True)
class BlockField:
    name: str
    offset: int
    is_multiplier: bool  # d: zero/subnormal matter; m/dmin: only NaN/Inf


# type name -> (block bytes, elements per block, fields)
BLOCK_LAYOUTS: dict[str, tuple[int, int, tuple[BlockField, ...]]] = {
    "Q4_0": (18, 32, (BlockField("d", 0, True),)),
    "Q4_1": (20, 32, (BlockField("d", 0, True), BlockField("m", 2, False))),
    "Q5_0": (22, 32, (BlockField("d", 0, True),)),
    "Q5_1": (24, 32, (BlockField("d", 0, True), BlockField("m", 2, False))),
    "Q8_0": (34, 32, (BlockField("d", 0, True),)),
    "Q2_K": (84, 256, (BlockField("d", 80, True), BlockField("dmin", 82, False))),
    "Q3_K": (110, 256, (BlockField("d", 108, True),)),
    "Q4_K": (144, 256, (BlockField("d", 0, True), BlockField("dmin", 2, False))),
    "Q5_K": (176, 256, (BlockField("d", 0, True), BlockField("dmin", 2, False))),
    "Q6_K": (210, 256, (BlockField("d", 208, True),)),
}

_FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}
_INT_TYPES = {"I8", "I16", "I32", "I64"}


def open_gguf(path: Path):  # -> gguf.GGUFReader
    """A `gguf.GGUFReader` for `path`, or ScanError if the file cannot be parsed.

    The reader's memmap is exposed to its own parser as a plain ndarray view of the same mapping:
    `np.memmap.__getitem__` bookkeeping dominates metadata parsing (a 49k-token vocabulary costs
    ~150k slices), and a plain view parses the same bytes about 3x faster. Tensor data stays
    memory-mapped.
    """
    try:
        from gguf import GGUFReader
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ScanError("scanning GGUF files needs the `gguf` package: pip install "
                        "'qforensics[scan]'") from exc

    class _PlainViewReader(GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain_data

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._mapped_data = value  # keeps the mapping alive
            self._plain_data = np.asarray(value)

    try:
        return _PlainViewReader(path, "r")
    except Exception as exc:  # untrusted input: any parser failure means a malformed file
        raise ScanError(f"{path}: malformed or unsupported GGUF file: {exc}. Re-download it or "
                        f"re-convert it with llama.cpp's convert_hf_to_gguf.py.") from exc


def _raw_bytes(tensor) -> np.ndarray:
    data = np.asarray(tensor.data)
    return data.reshape(-1).view(np.uint8)


def _block_tallies(blocks: np.ndarray, offset: int, fld: BlockField, order: str,
                   tallies: dict[str, Tally]) -> None:
    fmt = FLOAT_FORMATS["F16"]
    raw = blocks[:, fld.offset: fld.offset + 2].view(f"{order}u2").reshape(-1)
    if order != "<":
        raw = raw.astype("<u2")
    if fld.is_multiplier:
        vals = fmt.decode(raw)
        tally_mask(tallies, "nan", np.isnan(vals), vals, offset)
        tally_mask(tallies, "inf", np.isinf(vals), vals, offset)
        tally_mask(tallies, "zero_scale", vals == 0, vals, offset)
        tally_mask(tallies, "subnormal_scale", (np.abs(vals) < fmt.tiny) & (vals != 0), vals,
                   offset)
    else:
        bad = fmt.nonfinite(raw)
        if bad.any():
            idx = np.flatnonzero(bad)
            vals = fmt.decode(raw[idx])
            tallies.setdefault("nan", Tally()).add(np.isnan(vals), vals, offset, idx)
            tallies.setdefault("inf", Tally()).add(np.isinf(vals), vals, offset, idx)


def scan_gguf(path: Path, display: str, *, chunk_bytes: int,
              on_bytes: Callable[[int], None] | None = None
              ) -> tuple[FileSummary, list[Finding], list[Skipped]]:
    """Check every tensor of one GGUF file. Raises ScanError if the file cannot be parsed."""
    reader = open_gguf(path)
    host_little = sys.byteorder == "little"
    same = getattr(reader, "byte_order", "I") == "I"
    order = "<" if host_little == same else ">"
    summary = FileSummary(file=display, format="gguf", layout="gguf", bytes=path.stat().st_size)
    findings: list[Finding] = []
    skipped: list[Skipped] = []
    done = 0

    def progress(n: int) -> None:
        nonlocal done
        done += n
        if on_bytes is not None:
            on_bytes(n)

    for t in reader.tensors:
        ttype = t.tensor_type.name
        name = str(t.name)
        ne = [int(x) for x in t.shape]  # ggml order: ne[0] is the contiguous row length
        if ttype in _FLOAT_TYPES:
            fmt = FLOAT_FORMATS[ttype].with_byteorder(order)
            raw = _raw_bytes(t).view(fmt.raw)
            step = max(1, chunk_bytes // max(4, fmt.itemsize))
            chunks = ((s, raw[s: s + step]) for s in range(0, raw.size, step))
            tallies = tally_float_chunks(chunks, fmt, scale=False,
                                         on_chunk=lambda n, isz=fmt.itemsize: progress(n * isz))
            findings += findings_from_tallies(tallies, file=display, tensor=name,
                                              total=int(raw.size))
        elif ttype in _INT_TYPES:
            progress(int(t.n_bytes))
        elif ttype in BLOCK_LAYOUTS:
            block_bytes, block_elems, fields = BLOCK_LAYOUTS[ttype]
            raw = _raw_bytes(t)
            nblocks = raw.size // block_bytes
            if raw.size % block_bytes:
                raise ScanError(f"{path}: tensor {name!r}: {raw.size} bytes is not a whole number "
                                f"of {ttype} blocks ({block_bytes} bytes); the file is corrupt")
            blocks_all = raw.reshape(nblocks, block_bytes)
            per_row = ne[0] // block_elems if ne and ne[0] % block_elems == 0 else None
            step = max(1, chunk_bytes // block_bytes)
            for fld in fields:
                tallies: dict[str, Tally] = {}
                for s in range(0, nblocks, step):
                    chunk = blocks_all[s: s + step]
                    _block_tallies(chunk, s, fld, order, tallies)
                    if fld is fields[-1]:
                        progress(int(chunk.size))
                what = f"{ttype} block scales '{fld.name}'"
                findings += findings_from_tallies(
                    {k: v for k, v in tallies.items() if v.count}, file=display, tensor=name,
                    total=nblocks, what=what, block_elems=block_elems, blocks_per_row=per_row)
        else:
            skipped.append(Skipped(display, name, f"not checked (type {ttype})"))
            progress(int(t.n_bytes))
            continue
        summary.tensors += 1
    rest = summary.bytes - done
    if rest > 0 and on_bytes is not None:
        on_bytes(rest)
    return summary, findings, skipped
