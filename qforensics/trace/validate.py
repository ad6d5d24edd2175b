"""The one validator for untrusted HDF5 input: traces (trace/reader.py) and replay bundles.

Every check a reader needs before it trusts a file's structure or numbers lives here:

- `check_regular_file`: refuses a path that is not a regular file (a FIFO, a device, a socket,
  a directory) before anything opens it: opening a FIFO blocks forever, a device never ends;
- `open_hdf5`: opens a file read-only; a file left open by a killed writer (SWMR consistency
  flags) is opened for SWMR reading, and a file cut short (shorter than the end address its
  superblock records, e.g. copied while written or truncated by a crash) is opened through a
  wrapper that fails every read past the real end, so the intact part stays readable;
- `check_self_contained`: refuses soft and external links, virtual datasets and datasets with
  external storage anywhere in the file (each would make the reader open other files);
- `parse_json`: bounded size and nesting depth (no RecursionError, no memory blow-up);
- `checked_int`, `checked_span`, `valid_spans`: integer fields and offset + count bounds with
  Python ints (or an overflow-free vectorized form), refusing negative counts, non-finite values
  and anything past the end;
- `read` and `read_prefix`: every data read, with OSError (a damaged chunk, a cut-short file)
  turned into `TraceUnreadableError` naming the dataset and rows, or read as far as it goes.

Nothing here unpickles, and nothing imports torch.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import stat
import struct
from typing import Any

import h5py
import numpy as np
from h5py import h5d, h5l, h5o

from qforensics.errors import TraceFormatError, TraceUnreadableError
from qforensics.jsondoc import has_nonfinite_text, restore_nonfinite

__all__ = [
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "CutShortFile",
    "check_regular_file",
    "check_self_contained",
    "checked_int",
    "checked_span",
    "non_regular_kind",
    "open_hdf5",
    "parse_json",
    "read",
    "read_prefix",
    "valid_spans",
]

MAX_JSON_BYTES = 4 << 20
MAX_JSON_DEPTH = 64
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_UNREADABLE = (OSError, RuntimeError)  # h5py reports damaged chunks and headers as these


# -- opening -----------------------------------------------------------------------------------
class CutShortFile(io.RawIOBase):
    """A read-only view of a file that is shorter than its HDF5 superblock says: it reports the
    recorded size, and any read reaching past the real end raises OSError (HDF5 then fails that
    one object's read instead of parsing bytes that are not there)."""

    def __init__(self, path: str, recorded_size: int) -> None:
        super().__init__()
        self._f = open(path, "rb")  # noqa: SIM115 - closed in close()
        self.real_size = os.fstat(self._f.fileno()).st_size
        self.recorded_size = max(int(recorded_size), self.real_size)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.recorded_size}[whence]
        self._pos = base + int(offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buf: Any) -> int:
        n = len(buf)
        if self._pos + n > self.real_size:
            raise OSError(f"bytes [{self._pos}, {self._pos + n}) lie past the end of the "
                          f"cut-short file ({self.real_size} of {self.recorded_size} bytes)")
        self._f.seek(self._pos)
        got = self._f.readinto(buf)
        self._pos += got
        return got

    def close(self) -> None:
        self._f.close()
        super().close()


def recorded_size(path: str) -> int | None:
    """The end-of-file address the HDF5 superblock (at offset 0) records, or None."""
    with open(path, "rb") as fh:
        head = fh.read(64)
    if not head.startswith(_HDF5_SIGNATURE) or len(head) < 56:
        return None
    version = head[8]
    if version in (0, 1):
        size_off = head[13]
        if size_off != 8:
            return None
        pos = 24 + (4 if version == 1 else 0) + 16  # base, free-space addresses, then EOF
    elif version in (2, 3):
        if head[9] != 8:
            return None
        pos = 12 + 16  # base, superblock-extension addresses, then EOF
    else:
        return None
    return int(struct.unpack_from("<Q", head, pos)[0])


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def non_regular_kind(path: str | os.PathLike[str]) -> str | None:
    """What `path` is when it exists and is not a regular file ("a FIFO (named pipe)", "a
    directory", ...), else None. Follows symlinks; never opens the path."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def check_regular_file(path: str | os.PathLike[str], what: str = "trace",
                       error: type[Exception] = TraceFormatError) -> None:
    """Raise `error` (a QForensicsError: exit 2) unless `path` is an existing regular file.
    Called before any open: a FIFO would block the reader forever, a device never ends."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise error(f"{path}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    kind = non_regular_kind(path)
    if not stat.S_ISREG(mode):
        raise error(f"{path}: is {kind}, not a {what} file; give the path of a regular file")


def open_hdf5(path: str, what: str = "trace") -> tuple[h5py.File, str | None]:
    """Open `path` read-only. Returns (file, cut_note): cut_note is None for a whole file, or a
    sentence saying how many bytes of the recorded size are missing. Raises TraceFormatError."""
    check_regular_file(path, what)
    try:
        with open(path, "rb") as fh:
            sig = fh.read(8)
    except OSError as exc:
        raise TraceFormatError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if sig != _HDF5_SIGNATURE:
        raise TraceFormatError(f"{path}: not an HDF5 file (is this a qforensics {what}?)")
    try:
        return h5py.File(path, "r"), None
    except _UNREADABLE as exc:
        msg = str(exc)
    if "truncated file" in msg:
        return _open_cut_short(path, what)
    if "already open for write" in msg or "consistency flags" in msg:
        try:  # left behind by a killed writer: SWMR read still works
            return h5py.File(path, "r", swmr=True), None
        except _UNREADABLE as exc:
            msg = str(exc)
            if "truncated file" in msg:
                return _open_cut_short(path, what)
            raise TraceFormatError(f"{path}: cannot open (the writer did not close it): "
                                   f"{_short(exc)}") from None
    raise TraceFormatError(f"{path}: cannot open as HDF5: {_short(msg)}") from None


def _open_cut_short(path: str, what: str) -> tuple[h5py.File, str]:
    size = recorded_size(path)
    if size is None:
        raise TraceFormatError(f"{path}: the {what} is cut short and its superblock is "
                               "unreadable") from None
    view = CutShortFile(path, size)
    try:
        f = h5py.File(view, "r")
    except Exception as exc:  # noqa: BLE001 - h5py raises several types for a broken header
        view.close()
        raise TraceFormatError(f"{path}: the {what} is cut short ({view.real_size} of {size} "
                               f"bytes) and its header is gone: {_short(exc)}") from None
    note = (f"the file is cut short: {view.real_size:,} of {size:,} bytes "
            f"({size - view.real_size:,} missing at the end)")
    return f, note


def _short(exc: object, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


# -- structure ---------------------------------------------------------------------------------
def check_self_contained(f: h5py.File, path: str,
                         found: dict[str, h5py.Dataset] | None = None) -> list[str]:
    """Refuse soft/external links, virtual datasets and external storage anywhere in the file.
    Returns the groups that could not be listed (a damaged or cut-short file), which the caller
    reports as unreadable. `found`, when given, receives every dataset checked, by path without
    the leading slash (so that the reader need not look them up again).

    An intact file is walked in one pass of HDF5's own C visitors (`_walk_at_once`, about 4x
    faster than object by object); a file where that pass fails is walked object by object, so
    that what can be read is kept and what cannot is named."""
    try:
        _walk_at_once(f, path, found)
        return []
    except _UNREADABLE:
        pass
    bad: list[str] = []
    unreadable: list[str] = []
    stack: list[h5py.Group] = [f]
    seen = 0
    while stack:
        grp = stack.pop()
        gname = grp.name.rstrip("/")
        try:
            keys = list(grp.keys())
        except _UNREADABLE:
            unreadable.append(gname or "/")
            continue
        for key in keys:
            seen += 1
            if seen > 100_000:
                raise TraceFormatError(f"{path}: more than 100,000 objects; not a qforensics file")
            full = f"{gname}/{key}"
            try:
                link = grp.get(key, getlink=True)
                if not isinstance(link, h5py.HardLink):
                    bad.append(full + f" ({type(link).__name__})")
                    continue
                obj = grp.get(key)
            except _UNREADABLE:
                unreadable.append(full)
                continue
            if isinstance(obj, h5py.Group):
                stack.append(obj)
            elif isinstance(obj, h5py.Dataset):
                try:
                    if obj.is_virtual:
                        bad.append(full + " (virtual dataset)")
                    elif obj.external:
                        bad.append(full + " (external storage)")
                    elif found is not None:
                        found[full.lstrip("/")] = obj
                except _UNREADABLE:
                    unreadable.append(full)
    if bad:
        raise TraceFormatError(
            f"{path}: refusing links, virtual datasets or external storage at "
            f"{', '.join(sorted(bad)[:5])}; a qforensics file must be self-contained"
        )
    return sorted(unreadable)


_LINK_NAMES = {h5l.TYPE_SOFT: "SoftLink", h5l.TYPE_EXTERNAL: "ExternalLink"}
_MAX_OBJECTS = 100_000


def _walk_at_once(f: h5py.File, path: str, found: dict[str, h5py.Dataset] | None) -> None:
    """`check_self_contained` for an intact file: H5Lvisit for every link's type (it never
    follows a soft or external link), H5Ovisit for every object reached by hard links, each
    dataset's creation properties for virtual layout and external storage. Raises
    TraceFormatError as the walk does; OSError / RuntimeError when the file is damaged."""
    links: list[tuple[bytes, int]] = []

    def on_link(name: bytes, info: Any) -> int | None:
        links.append((name, info.type))
        return 1 if len(links) > _MAX_OBJECTS else None  # non-None stops the visit

    f.id.links.visit(on_link, info=True)
    if len(links) > _MAX_OBJECTS:
        raise TraceFormatError(f"{path}: more than 100,000 objects; not a qforensics file")
    bad = [f"/{n.decode('utf-8', 'replace')} ({_LINK_NAMES.get(t, 'user-defined link')})"
           for n, t in links if t != h5l.TYPE_HARD]
    datasets: list[bytes] = []
    if not bad:
        h5o.visit(f.id, lambda name, info: datasets.append(name)
                  if info.type == h5o.TYPE_DATASET else None, info=True)
    for name in datasets:
        dsid = h5d.open(f.id, name)
        plist = dsid.get_create_plist()
        full = "/" + name.decode("utf-8", "replace")
        if plist.get_layout() == h5d.VIRTUAL:
            bad.append(full + " (virtual dataset)")
        elif plist.get_external_count():
            bad.append(full + " (external storage)")
        elif found is not None:
            found[full.lstrip("/")] = h5py.Dataset(dsid)
    if bad:
        raise TraceFormatError(
            f"{path}: refusing links, virtual datasets or external storage at "
            f"{', '.join(sorted(bad)[:5])}; a qforensics file must be self-contained"
        )


# -- JSON --------------------------------------------------------------------------------------
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


def json_depth(raw: str) -> int:
    """Maximum nesting depth of brackets outside strings (no recursion)."""
    data = _STRING.sub(b'""', raw.encode("utf-8", "replace"))
    a = np.frombuffer(data, dtype=np.uint8)
    step = (np.isin(a, (ord("["), ord("{"))).astype(np.int64)
            - np.isin(a, (ord("]"), ord("}"))).astype(np.int64))
    return int(np.cumsum(step).max()) if len(step) else 0


def parse_json(raw: Any, where: str, *, max_bytes: int = MAX_JSON_BYTES,
               max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse a JSON attribute or string cell, bounded in size and nesting."""
    if isinstance(raw, np.ndarray) and raw.shape == ():
        raw = raw[()]
    if isinstance(raw, bytes):
        if len(raw) > max_bytes:
            raise TraceFormatError(f"{where}: JSON larger than {max_bytes} bytes")
        raw = raw.decode("utf-8", errors="replace")
    if not isinstance(raw, str):
        raise TraceFormatError(f"{where}: expected a JSON string, found {type(raw).__name__}")
    if len(raw) > max_bytes:
        raise TraceFormatError(f"{where}: JSON larger than {max_bytes} bytes")
    # depth <= the number of opening brackets: only a text with more of them needs the scan
    if raw.count("[") + raw.count("{") > max_depth and json_depth(raw) > max_depth:
        raise TraceFormatError(f"{where}: JSON nested deeper than {max_depth} levels")
    try:
        value = json.loads(raw, parse_constant=_constant)
    except (json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise TraceFormatError(f"{where}: invalid JSON ({_short(exc, 120)})") from None
    # jsondoc's non-finite policy: "nan", "inf", "-inf" are floats; integer fields refuse them
    return restore_nonfinite(value) if has_nonfinite_text(raw) else value


_CONSTANTS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _constant(name: str) -> float:
    """A bare NaN/Infinity/-Infinity (traces written before the strings of jsondoc's policy)
    as its float; integer fields refuse it."""
    return _CONSTANTS[name]


# -- numbers -----------------------------------------------------------------------------------
def checked_int(value: Any, where: str, *, lo: int | None = None, hi: int | None = None) -> int:
    """An integer field as a Python int: refuses NaN/Inf, fractions, bools-as-strings, out of
    [lo, hi]."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TraceFormatError(f"{where}: expected an integer, found {value!r:.60}")
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise TraceFormatError(f"{where}: expected an integer, found {value!r}")
        value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise TraceFormatError(f"{where}: {value} outside [{lo}, {hi}]")
    return int(value)


def checked_span(offset: Any, count: Any, limit: int, where: str) -> tuple[int, int]:
    """[offset, offset + count) as Python ints, inside [0, limit); negative counts refused."""
    off = checked_int(offset, f"{where}: offset")
    n = checked_int(count, f"{where}: count")
    if off < 0 or n < 0 or off + n > int(limit):
        raise TraceFormatError(f"{where}: span [{off}, {off} + {n}) out of bounds "
                               f"(the array holds {int(limit)})")
    return off, off + n


def valid_spans(offsets: np.ndarray, counts: np.ndarray, limit: int) -> np.ndarray:
    """Vectorized `checked_span`: True where 0 <= offset, 0 <= count and offset + count <= limit,
    computed as count <= limit - offset so no int64 sum can wrap."""
    off = np.asarray(offsets, dtype=np.int64)
    n = np.asarray(counts, dtype=np.int64)
    lim = np.int64(int(limit))
    ok = (off >= 0) & (n >= 0) & (off <= lim)
    room = np.where(ok, lim - np.where(ok, off, 0), -1)
    return ok & (n <= room)


# -- reads -------------------------------------------------------------------------------------
def read(ds: h5py.Dataset, sel: Any, where: str) -> np.ndarray:
    """`ds[sel]`, with a damaged chunk or a cut-short file reported as TraceUnreadableError."""
    try:
        return ds[sel]
    except _UNREADABLE as exc:
        raise TraceUnreadableError(f"{where}: unreadable {_describe(ds, sel)} "
                                   f"({_short(exc, 160)})") from None


def read_prefix(ds: h5py.Dataset, start: int, stop: int) -> tuple[np.ndarray, int | None]:
    """Rows [start, stop) of `ds` as far as they can be read: (rows, first_unreadable_row or
    None). On a read error, reads chunk by chunk and stops at the first damaged chunk."""
    try:
        return ds[start:stop], None
    except _UNREADABLE:
        pass
    block = int(ds.chunks[0]) if ds.chunks else max(1, stop - start)
    parts = []
    pos = start
    while pos < stop:
        end = min(stop, (pos // block + 1) * block)
        try:
            parts.append(ds[pos:end])
        except _UNREADABLE:
            break
        pos = end
    empty = np.zeros((0,) + tuple(ds.shape[1:]), dtype=ds.dtype)
    rows = np.concatenate(parts) if parts else empty
    return rows, (pos if pos < stop else None)


def _describe(ds: h5py.Dataset, sel: Any) -> str:
    name = ds.name or "?"
    if isinstance(sel, slice):
        return f"{name}[{sel.start or 0}:{'' if sel.stop is None else sel.stop}]"
    return name
