"""The C pieces capture builds are loaded only from a path nobody else can write
(hooks/fused.py `trusted`, `build`): a cache folder or file others can write is never loaded
from; the library is built into a private folder of the process instead."""

from __future__ import annotations

import os

from qforensics.hooks import fused


def test_a_private_cache_is_trusted_and_reused(tmp_path):
    cache = tmp_path / "kernels"
    first = fused.build(out_dir=cache)
    assert first.parent == cache and fused.trusted(first)
    assert fused.build(out_dir=cache) == first  # found, not rebuilt


def test_a_world_writable_cache_is_never_loaded_from(tmp_path):
    cache = tmp_path / "shared"
    cache.mkdir()
    planted = fused.library_path(out_dir=cache)
    planted.write_bytes(b"not a library")  # what another user could leave there
    os.chmod(cache, 0o777)
    assert not fused.trusted(planted)
    got = fused.build(out_dir=cache)
    assert got != planted and got.read_bytes() != b"not a library"
    assert fused.trusted(got) and got.parent != cache


def test_a_group_writable_library_is_not_trusted(tmp_path):
    cache = tmp_path / "kernels"
    lib = fused.build(out_dir=cache)
    os.chmod(lib, 0o664)
    assert not fused.trusted(lib)
    assert fused.build(out_dir=cache) != lib


def test_a_symlink_is_not_trusted(tmp_path):
    cache = tmp_path / "kernels"
    lib = fused.build(out_dir=cache)
    link = tmp_path / "link.so"
    link.symlink_to(lib)
    assert not fused.trusted(link)
