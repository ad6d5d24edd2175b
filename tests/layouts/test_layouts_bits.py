"""Packing primitives against words built by hand with explicit shifts, and against
compressed-tensors' own pack_to_int32 / unpack_from_int32 (an independent implementation)."""

from __future__ import annotations

import numpy as np
import pytest

from qforensics.layouts.bits import LayoutError, pack_awq, pack_bits, unpack_awq, unpack_bits


def _word(codes: list[int], bits: int) -> int:
    """One int32 from codes, code i in bits [i*b, (i+1)*b) (two's complement)."""
    v = 0
    for i, c in enumerate(codes):
        v |= int(c) << (bits * i)
    return v - (1 << 32) if v >= 1 << 31 else v


def test_awq_nibble_order_by_hand():
    cols = np.arange(8).reshape(1, 8)  # column j holds the value j
    word = int(pack_awq(cols)[0, 0])
    # AutoAWQ: nibble i holds column [0, 2, 4, 6, 1, 3, 5, 7][i]
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == [0, 2, 4, 6, 1, 3, 5, 7]
    rng = np.random.default_rng(0)
    vals = rng.integers(0, 16, (5, 24))
    words = np.array([[_word([vals[r, 8 * c + o] for o in (0, 2, 4, 6, 1, 3, 5, 7)], 4) for c in range(3)]
                      for r in range(5)], dtype=np.int32)
    np.testing.assert_array_equal(pack_awq(vals), words)
    np.testing.assert_array_equal(unpack_awq(words), vals)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_sequential_by_hand(bits):
    per = 32 // bits
    rng = np.random.default_rng(bits)
    vals = rng.integers(0, 1 << bits, (3, 2 * per))
    words = np.array([[_word(list(vals[r, per * w: per * (w + 1)]), bits) for w in range(2)] for r in range(3)],
                     dtype=np.int32)
    np.testing.assert_array_equal(pack_bits(vals, bits, axis=1), words)
    np.testing.assert_array_equal(unpack_bits(words, bits, axis=1), vals)
    np.testing.assert_array_equal(unpack_bits(words.T, bits, axis=0), vals.T)  # along the other axis


def test_three_bit_codes_straddle_words():
    vals = np.arange(11) % 8  # 33 bits: code 10 sits in bits 30..32, across the two words
    words = pack_bits(vals[None, :], 3, axis=1)
    stream = sum(int(v) << (3 * i) for i, v in enumerate(vals))
    expect = [stream & 0xFFFFFFFF, stream >> 32]
    assert [int(w) & 0xFFFFFFFF for w in words[0]] == expect
    np.testing.assert_array_equal(unpack_bits(words, 3, axis=1, count=11)[0], vals)


def test_refusals():
    with pytest.raises(LayoutError):
        pack_bits(np.array([[16]]), 4)
    with pytest.raises(LayoutError):
        unpack_bits(np.zeros((2, 2), np.int64), 4)
    with pytest.raises(LayoutError):
        pack_awq(np.zeros((2, 7), np.int64))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_dense_packing_matches_compressed_tensors(bits, dim):
    torch = pytest.importorskip("torch")
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    rng = np.random.default_rng(10 * bits + dim)
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    signed = rng.integers(lo, hi, (6, 37)).astype(np.int8)
    ref = helpers.pack_to_int32(torch.from_numpy(signed), bits, packed_dim=dim).numpy()
    ours = pack_bits(signed.astype(np.int16) - lo, bits, axis=dim)
    np.testing.assert_array_equal(ours, ref)
    back = unpack_bits(ref, bits, axis=dim, count=signed.shape[dim]).astype(np.int16) + lo
    np.testing.assert_array_equal(back, signed)
    lib = helpers.unpack_from_int32(torch.from_numpy(ours), bits, torch.Size(signed.shape), packed_dim=dim)
    np.testing.assert_array_equal(lib.numpy(), signed)
