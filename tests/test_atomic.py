"""The one atomic write (qforensics.atomic): the target is the old one or the whole new one."""

from __future__ import annotations

import pytest

from qforensics.atomic import replacing, write_bytes, write_text


def test_write_replaces_in_one_step_and_leaves_nothing_beside(tmp_path):
    p = tmp_path / "out.html"
    p.write_text("old")
    assert write_text(p, "new") == p and p.read_text() == "new"
    assert write_bytes(p, b"\x00\x01") == p and p.read_bytes() == b"\x00\x01"
    assert [x.name for x in tmp_path.iterdir()] == ["out.html"]


def test_a_failed_write_keeps_the_old_target_and_removes_the_temporary(tmp_path):
    p = tmp_path / "out.json"
    p.write_text("old")
    with pytest.raises(RuntimeError, match="half"):
        with replacing(p, suffix=".so") as tmp:
            assert tmp.parent == tmp_path and tmp.name.endswith(".so") and not tmp.exists()
            tmp.write_text("half")
            raise RuntimeError("half written")
    assert p.read_text() == "old" and [x.name for x in tmp_path.iterdir()] == ["out.json"]


def test_a_folder_goes_in_whole_and_one_already_there_stays(tmp_path):
    dst = tmp_path / "cache" / "model"
    with replacing(dst, directory=True, keep_existing=True) as tmp:
        assert tmp.is_dir()
        (tmp / "config.json").write_text("{}")
    assert (dst / "config.json").read_text() == "{}"
    with replacing(dst, directory=True, keep_existing=True) as tmp:  # another got there first
        (tmp / "config.json").write_text("ours")
    assert (dst / "config.json").read_text() == "{}"
    assert [x.name for x in dst.parent.iterdir()] == ["model"]
    with pytest.raises(OSError):
        with replacing(dst, directory=True) as tmp:
            (tmp / "x").write_text("x")
    assert [x.name for x in dst.parent.iterdir()] == ["model"]
