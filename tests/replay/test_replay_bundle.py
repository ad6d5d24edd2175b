"""Replay bundles: built from numpy snapshots or a trace, round-tripped, validated, refused when unsafe."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
from replay_helpers import FakeTrace, fake_opener, make_awq

from qforensics.errors import ReplayError
from qforensics.layouts import awq
from qforensics.layouts.bits import AWQ_ORDER, pack_awq, unpack_awq
from qforensics.replay.build import build_bundle, build_bundle_from_trace, choose_call
from qforensics.replay.bundle import FORMAT_NAME, kernel_tensors, read_bundle


def test_awq_pack_roundtrip_and_nibble_order():
    vals = np.arange(16, dtype=np.int64).reshape(2, 8) % 16
    words = pack_awq(vals)
    assert words.dtype == np.int32 and words.shape == (2, 1)
    # column 8c+j lives in nibble REVERSE[j]; nibble i holds column ORDER[i]
    w0 = int(words[0, 0]) & 0xFFFFFFFF
    assert [(w0 >> (4 * i)) & 0xF for i in range(8)] == [int(vals[0, o]) for o in AWQ_ORDER]
    np.testing.assert_array_equal(unpack_awq(words), vals)


def test_small_awq_snapshot_roundtrip_and_reference(tmp_path):
    snap = make_awq(5, 64, 128, 64)
    b = build_bundle(snap, {"group_size": 64, "call_index": 4, "module": "m"}, tmp_path / "b.h5")
    r = read_bundle(tmp_path / "b.h5")
    assert r.meta["M"] == 5 and r.meta["N"] == 64 and r.meta["K"] == 128 and r.meta["group_size"] == 64
    assert r.meta["layout"] == "awq-gemm" and r.meta["call_index"] == 4
    w = awq.dequantize(snap["qweight"], snap["qzeros"], snap["scales"], 64)
    np.testing.assert_array_equal(r.reference, snap["input.0"].astype(np.float64) @ w)
    for name in ("qweight", "qzeros", "scales"):
        np.testing.assert_array_equal(r.tensors[name], snap[name])
    assert r.reference.dtype == np.float64
    with h5py.File(tmp_path / "b.h5") as f:
        assert f.attrs["format"] == FORMAT_NAME and f.attrs["format_version"] == "2.0"
    assert b.path == tmp_path / "b.h5"


def test_large_input_keeps_the_tile_around_first_nonfinite(tmp_path):
    snap = make_awq(100, 128, 64, 32, lead=(2,))  # input [2, 100, 64] -> M = 200 rows
    out = np.zeros((2, 100, 128), np.float16)
    snap["output.0"] = out
    snap["nonfinite_positions"] = np.array([[1, 30, 70], [1, 29, 100]], np.int64)  # rows 129 and 130
    b = build_bundle(snap, {"group_size": 32})
    assert b.meta["first_nonfinite"] == [129, 100]
    assert (b.meta["row_start"], b.meta["row_stop"], b.meta["M"], b.meta["M_full"]) == (128, 136, 8, 200)
    np.testing.assert_array_equal(b.tensors["x"], snap["input.0"].reshape(-1, 64)[128:136])
    assert b.observed.shape == (8, 128)


def test_partial_last_tile_keeps_fewer_rows():
    snap = make_awq(70, 64, 64, 32)
    snap["output.0"] = np.zeros((70, 64), np.float32)
    snap["output.0"][69, 3] = np.nan
    b = build_bundle(snap, {"group_size": 32})
    assert (b.meta["row_start"], b.meta["row_stop"], b.meta["M"]) == (64, 70, 6)


def test_dense_snapshot_and_kernel_tensors():
    rng = np.random.default_rng(1)
    snap = {"input.0": rng.standard_normal((4, 64)).astype(np.float32),
            "weight": rng.standard_normal((128, 64)).astype(np.float32), "bias": np.ones(128, np.float32)}
    b = build_bundle(snap, {"group_size": 32})
    assert b.meta["layout"] == "dense" and b.meta["N"] == 128
    np.testing.assert_allclose(b.reference, snap["input.0"].astype(np.float64) @ snap["weight"].T.astype(np.float64))
    data, ref, notes = kernel_tensors(b)
    assert data["qweight"].shape == (64, 16) and data["scales"].shape == (2, 128)
    assert ref.shape == (4, 128) and "RTN" in notes[0]
    # RTN INT4 is close to the dense weight
    w = awq.dequantize(data["qweight"], data["qzeros"], data["scales"], 32)
    assert np.abs(w - snap["weight"].T).max() < 0.5


def test_group_index_out_of_range_is_refused_with_the_row(tmp_path):
    snap = make_awq(8, 64, 128, 64)
    g = (np.arange(128) // 64).astype(np.int32)
    g[5] = 7
    snap["g_idx"] = g
    with pytest.raises(ReplayError, match="group index 7 of input row 5"):
        build_bundle(snap, {"group_size": 64}, tmp_path / "g.h5")
    g[5] = 1  # in range: kept, and the reference honours it
    b = build_bundle(snap, {"group_size": 64}, tmp_path / "g.h5")
    np.testing.assert_array_equal(read_bundle(tmp_path / "g.h5").tensors["g_idx"], g)
    q = unpack_awq(snap["qweight"]).astype(np.float64)
    z = unpack_awq(snap["qzeros"]).astype(np.float64)
    w5 = (q[5] - z[1]) * snap["scales"][1].astype(np.float64)  # row 5 now reads group 1
    np.testing.assert_allclose(b.reference, snap["input.0"].astype(np.float64) @ np.vstack(
        [(q[k] - z[g[k]]) * snap["scales"][g[k]].astype(np.float64) if k != 5 else w5 for k in range(128)]))


def test_group_size_needed_when_ambiguous():
    snap = make_awq(8, 64, 100, 32, groups=3)
    with pytest.raises(ReplayError, match="group_size"):
        build_bundle(snap, {})


def test_gptq_packed_snapshot_is_read_as_gptq_not_as_awq():
    """qweight [K/8, N] packed sequentially along K, qzeros stored as zero - 1 (GPTQ v1)."""
    rng = np.random.default_rng(3)
    k, n, g = 64, 64, 32
    q = rng.integers(0, 16, (k, n))
    z = rng.integers(1, 16, (k // g, n))
    s = (rng.random((k // g, n)) * 0.01 + 0.001).astype(np.float16)
    qweight = np.zeros((k // 8, n), np.int64)
    for i in range(8):  # written here from the published layout, independently of the adapter
        qweight |= q[i::8] << (4 * i)
    qzeros = np.zeros((k // g, n // 8), np.int64)
    for i in range(8):
        qzeros |= (z[:, i::8] - 1) << (4 * i)
    snap = {"input.0": rng.standard_normal((3, k)).astype(np.float32), "qweight": qweight.astype(np.uint32).view(np.int32),
            "qzeros": qzeros.astype(np.uint32).view(np.int32), "scales": s}
    b = build_bundle(snap, {"group_size": g})
    assert b.meta["layout"] == "gptq"
    w = (q - z[np.arange(k) // g]) * s.astype(np.float64)[np.arange(k) // g]
    np.testing.assert_allclose(b.reference, snap["input.0"].astype(np.float64) @ w)


def _write_ok(tmp_path):
    p = tmp_path / "b.h5"
    build_bundle(make_awq(4, 64, 64, 32), {"group_size": 32}, p)
    return p


def test_reader_refuses_external_link(tmp_path):
    p = _write_ok(tmp_path)
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["x"] = np.zeros((4, 64), np.float16)
    with h5py.File(p, "a") as f:
        del f["tensors/x"]
        f["tensors/x"] = h5py.ExternalLink(str(tmp_path / "other.h5"), "/x")
    with pytest.raises(ReplayError, match="ExternalLink"):
        read_bundle(p)


def test_reader_refuses_soft_link_and_external_storage(tmp_path):
    p = _write_ok(tmp_path)
    with h5py.File(p, "a") as f:
        f["extra"] = h5py.SoftLink("/tensors/x")
    with pytest.raises(ReplayError, match="SoftLink"):
        read_bundle(p)
    p2 = _write_ok(tmp_path / "b")
    (tmp_path / "raw.bin").write_bytes(np.zeros((4, 64), np.float16).tobytes())
    with h5py.File(p2, "a") as f:
        del f["tensors/x"]
        f["tensors"].create_dataset("x", shape=(4, 64), dtype=np.float16,
                                    external=[(str(tmp_path / "raw.bin"), 0, 4 * 64 * 2)])
    with pytest.raises(ReplayError, match="external storage"):
        read_bundle(p2)


@pytest.mark.parametrize("mutate, match", [
    (lambda f: f.attrs.__setitem__("format_version", "3.0"), "upgrade qforensics"),
    (lambda f: f.attrs.__setitem__("format", "something-else"), "not a replay bundle"),
    (lambda f: (f["tensors"].__delitem__("qweight"), f["tensors"].create_dataset("qweight", data=np.zeros((64, 8), np.float32))), "dtype"),
    (lambda f: (f["tensors"].__delitem__("x"), f["tensors"].create_dataset("x", data=np.zeros((3, 64), np.float16))), "tensors/x"),
    (lambda f: f["tensors"].create_dataset("evil", data=np.zeros(3)), "unknown dataset"),
    (lambda f: f.attrs.__setitem__("meta", "not json"), "invalid JSON"),
    (lambda f: f.attrs.__setitem__("meta", "[" * 100 + "]" * 100), "nested deeper"),
])
def test_reader_validates(tmp_path, mutate, match):
    p = _write_ok(tmp_path)
    with h5py.File(p, "a") as f:
        mutate(f)
    with pytest.raises(ReplayError, match=match):
        read_bundle(p)


def test_reader_refuses_non_hdf5(tmp_path):
    p = tmp_path / "x.h5"
    p.write_bytes(b"not hdf5")
    with pytest.raises(ReplayError, match="not an HDF5 file"):
        read_bundle(p)


def test_from_trace_default_call_and_quant_info(tmp_path):
    snap = make_awq(3, 64, 96, 64, groups=2)
    trace = FakeTrace({2: ("first_outlier", make_awq(8, 64, 128, 64)), 9: ("first_nonfinite_output", snap),
                       12: ("first_nonfinite_output", snap)},
                      module_info={"quant": {"bits": 4, "group_size": 64, "format": "awq"}})
    b = build_bundle_from_trace("t.h5", tmp_path / "b.h5", open_trace=fake_opener(trace))
    assert b.meta["call_index"] == 9 and b.meta["group_size"] == 64 and b.meta["quant_format"] == "awq"
    assert b.meta["module"] == "model.layers.0.mlp.down_proj" and b.meta["reason"] == "first_nonfinite_output"
    assert trace.opened == ["t.h5"]
    b2 = build_bundle_from_trace("t.h5", None, 2, open_trace=fake_opener(trace))
    assert b2.meta["call_index"] == 2 and b2.meta["reason"] == "first_outlier"
    with pytest.raises(ReplayError, match="no snapshot for call 5"):
        build_bundle_from_trace("t.h5", None, 5, open_trace=fake_opener(trace))
    bad = FakeTrace({1: ("first_nonfinite_output", make_awq(8, 64, 64, 32))},
                    module_info={"quant": {"bits": 4, "group_size": 64, "format": "awq"}})
    with pytest.raises(ReplayError, match="2 scale rows, but K=64 with group_size=64 needs 1"):
        build_bundle_from_trace("t.h5", None, open_trace=fake_opener(bad))  # the trace contradicts itself


def test_from_trace_prefers_outlier_when_no_nonfinite_and_asks_for_call_otherwise():
    import pandas as pd
    t = FakeTrace({4: ("first_outlier", make_awq(8, 64, 64, 32))})
    assert choose_call(t.snapshots) == 4
    with pytest.raises(ReplayError, match="--call"):
        choose_call(pd.DataFrame({"call_index": [1], "reason": ["manual"]}))


def test_truncated_snapshot_refused():
    t = FakeTrace({1: ("first_nonfinite_output", make_awq(8, 64, 64, 32))}, truncated=True)
    with pytest.raises(ReplayError, match="truncated"):
        build_bundle_from_trace("t.h5", None, open_trace=fake_opener(t))


def test_meta_is_json(tmp_path):
    p = _write_ok(tmp_path)
    with h5py.File(p) as f:
        meta = json.loads(f.attrs["meta"])
    assert meta["layout"] == "awq-gemm" and meta["col_start"] == 0 and meta["N_full"] == 64
