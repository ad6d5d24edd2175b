"""Hostile bundles: structural and byte-level mutations never give a traceback or a clean verdict
about data that could not be read (hypothesis, bounded in time)."""

from __future__ import annotations

import json
import shutil

import h5py
import numpy as np
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from replay_helpers import make_awq

from qforensics.cli import main
from qforensics.errors import ReplayError
from qforensics.replay.build import build_bundle
from qforensics.replay.bundle import read_bundle

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
META_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                        st.text(max_size=20), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


def _good(tmp_path):
    p = tmp_path / "good.h5"
    if not p.exists():
        build_bundle(make_awq(8, 64, 128, 64), {"group_size": 64, "call_index": 1}, p)
    return p


def _check(path):
    """The reader either accepts or raises ReplayError; the CLI exits 0/1/2 with no traceback."""
    try:
        read_bundle(path)
    except ReplayError:
        pass
    r = CliRunner().invoke(main, ["replay", str(path), "--kernel", "torch-int4pack", "--sanitize", "off"])
    assert r.exit_code in (0, 1, 2), (r.exit_code, r.output, r.exception)
    assert "Traceback" not in r.output
    if r.exit_code == 0:  # "measured and NOT REPRODUCED" only on data that really was read
        assert read_bundle(path).meta["M"] > 0


@SETTINGS
@given(offsets=st.lists(st.integers(0, 10**9), min_size=1, max_size=4), values=st.lists(st.integers(0, 255), min_size=4, max_size=4))
def test_byte_flips(tmp_path, offsets, values):
    good = _good(tmp_path)
    data = bytearray(good.read_bytes())
    for off, v in zip(offsets, values):
        data[off % len(data)] = v
    p = tmp_path / "flipped.h5"
    p.write_bytes(bytes(data))
    _check(p)


@SETTINGS
@given(key=st.sampled_from(["M", "N", "K", "layout", "group_size", "row_start", "col_start", "fake_quant", "weight_dtype",
                            "weight_block_size", "zero_plus_one", "saturate", "fixture"]), value=META_VALUES)
def test_meta_values(tmp_path, key, value):
    p = tmp_path / "meta.h5"
    shutil.copy(_good(tmp_path), p)
    with h5py.File(p, "a") as f:
        meta = json.loads(f.attrs["meta"])
        meta[key] = value
        f.attrs["meta"] = json.dumps(meta)
    _check(p)


@SETTINGS
@given(name=st.sampled_from(["x", "qweight", "qzeros", "scales", "g_idx", "weight", "input_scale"]),
       shape=st.lists(st.integers(0, 9), min_size=0, max_size=3),
       dtype=st.sampled_from(["float16", "float32", "float64", "int32", "uint8", "int64"]),
       fill=st.sampled_from([0.0, np.nan, np.inf, 7.0]))
def test_replaced_datasets(tmp_path, name, shape, dtype, fill):
    p = tmp_path / "ds.h5"
    shutil.copy(_good(tmp_path), p)
    with h5py.File(p, "a") as f:
        if name in f["tensors"]:
            del f["tensors"][name]
        arr = np.full(shape, fill if np.dtype(dtype).kind == "f" else 7, dtype=dtype)
        f["tensors"].create_dataset(name, data=arr)
    _check(p)


def test_truncated_files(tmp_path):
    good = _good(tmp_path).read_bytes()
    for cut in (1, 100, len(good) // 2, len(good) - 1):
        p = tmp_path / f"cut{cut}.h5"
        p.write_bytes(good[:cut])
        _check(p)
