"""check_self_contained's one-pass walk (HDF5's C visitors) against the object-by-object walk
it falls back to: the same datasets found on an intact trace, the same refusals on hostile ones,
and the fallback taken on a damaged file."""

from __future__ import annotations

import shutil

import h5py
import pytest
from hostile import sample

from qforensics.errors import TraceFormatError
from qforensics.trace import validate


def _walk(path, monkeypatch, *, fast: bool):
    if not fast:
        def fail(*a, **k):
            raise OSError("walk object by object")
        monkeypatch.setattr(validate, "_walk_at_once", fail)
    found: dict = {}
    with h5py.File(path, "r") as f:
        try:
            lost = validate.check_self_contained(f, str(path), found=found)
        except TraceFormatError as exc:
            return "refused", str(exc)
        finally:
            monkeypatch.undo()
    return sorted(found), lost


def test_both_walks_find_the_same_datasets(monkeypatch):
    p = sample("fp8-e4m3-nosat-act")
    fast, slow = _walk(p, monkeypatch, fast=True), _walk(p, monkeypatch, fast=False)
    assert fast == slow
    with h5py.File(p, "r") as f:
        every: list[str] = []
        f.visititems(lambda n, o: every.append(n) if isinstance(o, h5py.Dataset) else None)
    assert fast[0] == sorted(every) and fast[1] == []


@pytest.mark.parametrize("kind", ["external link", "soft link", "external storage", "virtual"])
def test_both_walks_refuse_the_same(tmp_path, monkeypatch, kind):
    p = tmp_path / "t.h5"
    shutil.copyfile(sample("fp16-reference"), p)
    raw = tmp_path / "raw.bin"
    raw.write_bytes(bytes(64))
    with h5py.File(p, "r+") as f:
        if kind == "external link":
            f["meta/x"] = h5py.ExternalLink("/etc/passwd", "/")
        elif kind == "soft link":
            f["modules/x"] = h5py.SoftLink("/steps")
        elif kind == "external storage":
            f.create_dataset("meta/x", shape=(16,), dtype="f4", external=[(str(raw), 0, 64)])
        else:
            lay = h5py.VirtualLayout(shape=(4,), dtype="f4")
            lay[:] = h5py.VirtualSource(str(raw), "d", shape=(4,))
            f.create_virtual_dataset("meta/x", lay, fillvalue=0)
    fast, slow = _walk(p, monkeypatch, fast=True), _walk(p, monkeypatch, fast=False)
    assert fast == slow and fast[0] == "refused"
    word = {"external link": "ExternalLink", "soft link": "SoftLink",
            "external storage": "external storage", "virtual": "virtual dataset"}[kind]
    assert word in fast[1]


def test_a_damaged_file_takes_the_object_by_object_walk(tmp_path, monkeypatch):
    p = tmp_path / "cut.h5"
    data = sample("fp16-reference").read_bytes()
    p.write_bytes(data[: len(data) // 2])
    calls = []
    real = validate._walk_at_once

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(validate, "_walk_at_once", spy)
    f, cut = validate.open_hdf5(str(p), "trace")  # half the file: the header is still there
    assert cut is not None
    with f:
        lost = validate.check_self_contained(f, str(p), found={})
    assert calls and lost  # the fast walk ran, failed, and the fallback named what is lost
    assert all(isinstance(x, str) for x in lost)
