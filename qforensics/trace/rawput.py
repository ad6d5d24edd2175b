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

import functools
import io
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
    all allocated, found by its position in HDF5's chunk index. The order of that index is
    the library's (for one unlimited dimension, HDF5 2.0 lists chunks column of chunks by
    column of chunks), and the coordinates h5py 3.16 reports for 2-D chunks are not the
    chunk's; so the order is learnt from a probe dataset of the same shape in memory."""
    per_row = -(-int(ds.shape[1]) // int(ds.chunks[1]))
    if ds.id.get_num_chunks() != ds.shape[0] * per_row:
        raise OSError(f"{ds.name}: not every chunk is allocated")
    order = _chunk_order(tuple(ds.shape), tuple(ds.chunks), tuple(ds.maxshape))
    i = order.get((row, col))
    if i is None:
        raise OSError(f"{ds.name}: chunk ({row}, {col}) not in the probe's index")
    info = ds.id.get_chunk_info(i)
    if info.byte_offset is None or info.size != int(ds.chunks[1]) * ds.dtype.itemsize:
        raise OSError(f"{ds.name}: chunk {i} is not where its index says")
    return int(info.byte_offset)


@functools.lru_cache(maxsize=32)
def _chunk_order(shape: tuple[int, int], chunks: tuple[int, int],
                 maxshape: tuple[int | None, ...]) -> dict[tuple[int, int], int]:
    """{(row, column of chunks): position in the chunk index} for a dataset created as the
    ring's are (empty, then resized to `shape`), each chunk marked with its own coordinates."""
    rows, width = shape
    c = chunks[1]
    buf = io.BytesIO()
    f = h5py.File(buf, "w", libver="latest")
    try:
        d = f.create_dataset("x", shape=(rows, 0), maxshape=maxshape, dtype="i8",
                             chunks=chunks)
        d.resize(shape)
        mark = np.zeros(shape, np.int64)
        for r in range(rows):
            mark[r, ::c] = r * (1 << 32) + np.arange(len(mark[r, ::c]))
        d[:, :] = mark
        f.flush()
        out = {}
        for i in range(d.id.get_num_chunks()):
            info = d.id.get_chunk_info(i)
            raw = buf.getbuffer()[info.byte_offset:info.byte_offset + 8].tobytes()
            v = int(np.frombuffer(raw, np.int64)[0])
            out[(v >> 32, v & 0xFFFFFFFF)] = i
        if len(out) != rows * -(-width // c):
            raise OSError("the probe's chunk index did not name every chunk once")
        return out
    finally:
        f.close()
