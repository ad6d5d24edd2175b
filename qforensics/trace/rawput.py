"""Bytes into a trace's fixed regions without HDF5: what trace/fallback.py writes at close once
HDF5's own writes fail.

After a failed write HDF5 holds dirty chunks of the appended tables that it cannot put on
disk, and every later flush (even of an in-place write) fails on them. The fixed regions (the
summaries, the ring) have their bytes at fixed file offsets: a contiguous dataset's from
`get_offset()`, an unfiltered chunk's from `get_chunk_info_by_coord()`. This writes there with
`os.pwrite`, inside the file's current size only (no allocation, so a full disk takes it), and
only where the file's type has the array's exact byte layout. Nothing here imports torch.
"""

from __future__ import annotations

import os

import h5py
import numpy as np


class RawRegion:
    """Raw writes into the fixed datasets of one open file (descriptor `fd`)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.size = os.fstat(fd).st_size

    def _pwrite(self, data: bytes, offset: int) -> None:
        if offset < 0 or offset + len(data) > self.size:
            raise OSError(f"bytes [{offset}, {offset + len(data)}) lie past the file's end")
        if os.pwrite(self.fd, data, offset) != len(data):
            raise OSError("short write")

    @staticmethod
    def _same_layout(ds: h5py.Dataset, arr: np.ndarray) -> None:
        t = ds.id.get_type()
        if t.get_size() != arr.dtype.itemsize:
            raise TypeError(f"{ds.name}: file type of {t.get_size()} bytes, array "
                            f"{arr.dtype.itemsize}")
        if arr.dtype.names:
            for i, name in enumerate(arr.dtype.names):
                if (t.get_member_name(i).decode() != name
                        or t.get_member_offset(i) != arr.dtype.fields[name][1]):
                    raise TypeError(f"{ds.name}: member {name} not at its numpy offset")

    def put(self, ds: h5py.Dataset, start: int, values: np.ndarray) -> None:
        """ds.flat[start:start + len] = values, for a contiguous dataset."""
        arr = np.ascontiguousarray(values, dtype=ds.dtype)
        self._same_layout(ds, arr)
        base = ds.id.get_offset()
        if base is None:
            raise OSError(f"{ds.name}: no storage allocated")
        self._pwrite(arr.tobytes(), int(base) + int(start) * arr.dtype.itemsize)

    def put_row(self, ds: h5py.Dataset, row: int, values: np.ndarray) -> None:
        """ds[row, :len(values)] = values for a 2-D dataset chunked (1, C), unfiltered, every
        chunk allocated (the ring's are, once it turned)."""
        arr = np.ascontiguousarray(values, dtype=ds.dtype)
        self._same_layout(ds, arr)
        if ds.chunks is None or ds.chunks[0] != 1 or ds.compression or ds.shuffle:
            raise TypeError(f"{ds.name}: not unfiltered (1, C) chunks")
        width = int(ds.chunks[1])
        if len(arr) > ds.shape[1]:
            raise ValueError(f"{ds.name}: {len(arr)} values, rows of {ds.shape[1]}")
        for c0 in range(0, len(arr), width):
            off = _chunk_offset(ds, row, c0 // width)
            self._pwrite(arr[c0:c0 + width].tobytes(), off)


def _chunk_offset(ds: h5py.Dataset, row: int, col: int) -> int:
    """The file offset of chunk (row, col) of a (1, C)-chunked 2-D dataset whose chunks are
    all allocated. Found by position in HDF5's chunk index (row-major), because the
    coordinates HDF5 2.0 reports and takes for 2-D chunks are not the chunk's (h5py 3.16: the
    chunk of row 12 reads as (0, 12 * C)); either form is accepted as a check, nothing else."""
    per_row = -(-int(ds.shape[1]) // int(ds.chunks[1]))
    if ds.id.get_num_chunks() != ds.shape[0] * per_row:
        raise OSError(f"{ds.name}: not every chunk is allocated")
    i = row * per_row + col
    info = ds.id.get_chunk_info(i)
    c = int(ds.chunks[1])
    if tuple(info.chunk_offset or ()) not in ((row, col * c), (0, i * c)) \
            or info.byte_offset is None or info.size != c * ds.dtype.itemsize:
        raise OSError(f"{ds.name}: chunk {i} is not where its index says")
    return int(info.byte_offset)
