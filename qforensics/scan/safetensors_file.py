"""A small, validating safetensors reader: header parser plus numpy memmap, no safetensors import.

Format: 8-byte little-endian header length N, N bytes of JSON mapping tensor name to
`{"dtype", "shape", "data_offsets": [begin, end]}` (offsets relative to the byte after the header)
plus an optional `"__metadata__"` string map, then the data. The header is checked before any data
is touched: known dtype, non-negative integer shape, offsets inside the file, byte length equal to
numel * element size, no two tensors overlapping. Any violation raises `ScanError` naming the file
and tensor. Data is read through `np.memmap`, chunk by chunk, so large files stay memory-bounded.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import numpy as np

from qforensics.errors import ScanError
from qforensics.scan.dtypes import FLOAT_FORMATS, INT_DTYPES, SAFETENSORS_BITS

__all__ = ["TensorEntry", "SafetensorsFile", "MAX_HEADER_BYTES"]

# The reference implementation refuses headers above 100 MB; so do we.
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the header describes it. `begin`/`end` are relative to the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def _fail(path: Path, what: str) -> ScanError:
    return ScanError(f"{path}: malformed safetensors file: {what}. The file is truncated or "
                     f"corrupt; re-download or re-save it (safetensors.torch.save_file).")


class SafetensorsFile:
    """Parsed header of one .safetensors file, with chunked raw reads of its tensors."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.size = self.path.stat().st_size
            with open(self.path, "rb") as fh:
                head = fh.read(8)
                if len(head) < 8:
                    raise _fail(self.path, f"file is {self.size} bytes, shorter than the 8-byte "
                                           f"header length")
                (n,) = struct.unpack("<Q", head)
                if n > self.size - 8:
                    raise _fail(self.path, f"header length {n} exceeds the file size "
                                           f"{self.size} - 8")
                if n > MAX_HEADER_BYTES:
                    raise _fail(self.path, f"header length {n} exceeds {MAX_HEADER_BYTES} bytes")
                raw_header = fh.read(n)
        except OSError as exc:
            raise ScanError(f"{self.path}: cannot read: {exc.strerror or exc}") from exc
        self.header_bytes = n
        self.data_start = 8 + n
        self.data_size = self.size - self.data_start
        try:
            header = json.loads(raw_header.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise _fail(self.path, f"header is not valid UTF-8 JSON ({exc})") from None
        if not isinstance(header, dict):
            raise _fail(self.path, "header JSON is not an object")
        meta = header.pop("__metadata__", None)
        if meta is not None and not (
            isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
        ):
            raise _fail(self.path, "__metadata__ is not a map of strings")
        self.metadata: dict[str, str] = dict(meta or {})
        entries = [self._parse_entry(name, spec) for name, spec in header.items()]
        entries.sort(key=lambda e: (e.begin, e.end))
        prev: TensorEntry | None = None
        for e in entries:
            if prev is not None and e.begin < prev.end:
                raise _fail(self.path, f"tensors {prev.name!r} and {e.name!r} overlap (bytes "
                                       f"{prev.begin}..{prev.end} and {e.begin}..{e.end})")
            if e.nbytes:
                prev = e
        self.entries: dict[str, TensorEntry] = {e.name: e for e in entries}
        self._mm: np.ndarray | None = None

    def _parse_entry(self, name: str, spec: Any) -> TensorEntry:
        where = f"tensor {name!r}"
        if not isinstance(spec, dict):
            raise _fail(self.path, f"{where}: entry is not an object")
        dtype = spec.get("dtype")
        shape = spec.get("shape")
        offsets = spec.get("data_offsets")
        if dtype not in SAFETENSORS_BITS:
            raise _fail(self.path, f"{where}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise _fail(self.path, f"{where}: shape {shape!r} is not a list of non-negative "
                                   f"integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(
            isinstance(o, int) and not isinstance(o, bool) for o in offsets
        )):
            raise _fail(self.path, f"{where}: data_offsets {offsets!r} is not [begin, end]")
        begin, end = offsets
        if not 0 <= begin <= end <= self.data_size:
            raise _fail(self.path, f"{where}: data_offsets [{begin}, {end}] fall outside the "
                                   f"{self.data_size}-byte data section")
        bits = math.prod(shape) * SAFETENSORS_BITS[dtype]
        if bits % 8 or bits // 8 != end - begin:
            raise _fail(self.path, f"{where}: shape {shape} x {dtype} needs {bits / 8:g} bytes "
                                   f"but data_offsets span {end - begin}")
        return TensorEntry(name, dtype, tuple(shape), begin, end)

    # -- data ---------------------------------------------------------------------------------

    def _data(self) -> np.ndarray:
        if self._mm is None:
            if self.data_size == 0:
                self._mm = np.zeros(0, dtype=np.uint8)
            else:
                try:
                    mm = np.memmap(self.path, dtype=np.uint8, mode="r",
                                   offset=self.data_start, shape=(self.data_size,))
                except (OSError, ValueError) as exc:
                    raise ScanError(f"{self.path}: cannot map the data section: {exc}") from exc
                self._mm = np.asarray(mm)  # plain ndarray view; keeps the map alive
        return self._mm

    def close(self) -> None:
        self._mm = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def raw_dtype(self, entry: TensorEntry) -> np.dtype | None:
        """Unsigned (float) or native (integer) element view, or None for unreadable dtypes."""
        if entry.dtype in FLOAT_FORMATS:
            return FLOAT_FORMATS[entry.dtype].raw
        return INT_DTYPES.get(entry.dtype)

    def read(self, entry: TensorEntry, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Elements [start, stop) of a tensor as a flat array of its raw element dtype."""
        dt = self.raw_dtype(entry)
        if dt is None:
            raise ScanError(f"{self.path}: tensor {entry.name!r}: dtype {entry.dtype} cannot "
                            f"be read element-wise")
        stop = entry.numel if stop is None else stop
        isz = dt.itemsize
        buf = self._data()[entry.begin + start * isz: entry.begin + stop * isz]
        return buf.view(dt)

    def read_all(self, entry: TensorEntry) -> np.ndarray:
        """The whole tensor in its shape (for the small structural tensors: g_idx, qzeros)."""
        return self.read(entry).reshape(entry.shape)

    def chunks(self, entry: TensorEntry, chunk_bytes: int) -> Iterator[tuple[int, np.ndarray]]:
        """(offset, raw) chunks of at most chunk_bytes once decoded (float32 or wider)."""
        step = max(1, chunk_bytes // max(4, self.raw_dtype(entry).itemsize))
        n = entry.numel
        for start in range(0, n, step):
            yield start, self.read(entry, start, min(n, start + step))
