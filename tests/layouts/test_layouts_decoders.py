"""Each decoder gives back the weight that the test builds from chosen integers and scales with
the format's documented rule (the packing written out here with explicit shifts), and agrees
with the real libraries where they are installed (compressed-tensors, torch's float8 casts)."""

from __future__ import annotations

import numpy as np
import pytest

from qforensics.layouts import LAYOUTS, LayoutError, awq, compressed, fp8, gptq, vllm_cpu


def _word(codes, bits=4):
    v = 0
    for i, c in enumerate(codes):
        v |= (int(c) & ((1 << bits) - 1)) << (bits * i)
    return v - (1 << 32) if v >= 1 << 31 else v


def _seq_along_rows(vals, bits=4):
    """[R, C] codes packed along R: word (r, c) holds vals[r*per + i, c] in bits [i*b, ...)."""
    per = 32 // bits
    return np.array([[_word([vals[r * per + i, c] for i in range(per)], bits) for c in range(vals.shape[1])]
                     for r in range(vals.shape[0] // per)], dtype=np.int32)


def _seq_along_cols(vals, bits=4):
    return _seq_along_rows(vals.T, bits).T.copy()


AWQ = (0, 2, 4, 6, 1, 3, 5, 7)


def test_awq_gemm_by_hand():
    rng = np.random.default_rng(0)
    k, n, g = 64, 16, 16
    q, z = rng.integers(0, 16, (k, n)), rng.integers(0, 16, (k // g, n))
    s = (rng.random((k // g, n)) * 0.1 + 0.01).astype(np.float16)
    qw = np.array([[_word([q[r, 8 * c + o] for o in AWQ]) for c in range(n // 8)] for r in range(k)], np.int32)
    qz = np.array([[_word([z[r, 8 * c + o] for o in AWQ]) for c in range(n // 8)] for r in range(k // g)], np.int32)
    expect = np.array([[(q[kk, j] - z[kk // g, j]) * float(s[kk // g, j]) for j in range(n)] for kk in range(k)])
    np.testing.assert_array_equal(awq.dequantize(qw, qz, s, g), expect)
    lay = LAYOUTS["awq-gemm"]
    t, meta = {"qweight": qw, "qzeros": qz, "scales": s}, {"K": k, "group_size": g}
    assert lay.can_take(t, meta) == ""
    np.testing.assert_array_equal(lay.weight_kn(t, meta), expect)
    assert "GPTQ" in lay.can_take(t, {"K": k * 8, "group_size": g})


def test_awq_out_of_range_group_is_refused():
    qw, qz = np.zeros((8, 1), np.int32), np.zeros((1, 1), np.int32)
    with pytest.raises(LayoutError, match="outside"):
        awq.dequantize(qw, qz, np.ones((1, 8), np.float16), 4)


def test_awq_rtn_round_trip():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(256, 64))
    qw, qz, s = awq.quantize_rtn(w, 32)
    err = np.abs(awq.dequantize(qw, qz, s, 32) - w)
    assert (err <= np.repeat(s.astype(np.float64), 32, 0) / 2 + 1e-12).all()  # half a step, everywhere


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("v2", [False, True])
def test_gptq_by_hand(bits, v2):
    rng = np.random.default_rng(bits)
    per, k, n, g = 32 // bits, 64, 32, 16
    top = 1 << bits
    q, z = rng.integers(0, top, (k, n)), rng.integers(1, top, (k // g, n))
    s = (rng.random((k // g, n)) * 0.1 + 0.01).astype(np.float16)
    g_idx = (np.arange(k) // g)[rng.permutation(k)]  # act-order
    qw = _seq_along_rows(q, bits)
    qz = _seq_along_cols(z - (0 if v2 else 1), bits)  # v1 stores zero - 1
    expect = np.array([[(q[kk, j] - z[g_idx[kk], j]) * float(s[g_idx[kk], j]) for j in range(n)]
                       for kk in range(k)])
    assert qw.shape == (k // per, n) and qz.shape == (k // g, n // per)
    np.testing.assert_array_equal(gptq.dequantize(qw, qz, s, bits, g, g_idx, v2=v2), expect)
    t = {"qweight": qw, "qzeros": qz, "scales": s, "g_idx": g_idx.astype(np.int32)}
    meta = {"K": k, "group_size": g, "bits": bits, "zero_plus_one": not v2}
    assert LAYOUTS["gptq"].can_take(t, meta) == ""
    np.testing.assert_array_equal(LAYOUTS["gptq"].weight_kn(t, meta), expect)


def test_gptq_symmetric_midpoint():
    assert gptq.sym_zero(4, v2=False) == 7 and gptq.sym_zero(4, v2=True) == 8
    assert gptq.is_v2("gptq_v2") and gptq.is_v2(None, 2) and not gptq.is_v2("gptq")


def _ct_layer(bits, asym, rng, n=24, k=64, g=16):
    torch = pytest.importorskip("torch")
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    q = rng.integers(lo, hi, (n, k)).astype(np.int8)
    zp = rng.integers(lo, hi, (n, k // g)).astype(np.int8) if asym else None
    s = (rng.random((n, k // g)) * 0.1 + 0.01).astype(np.float32)
    packed = helpers.pack_to_int32(torch.from_numpy(q), bits).numpy()
    pzp = None if zp is None else helpers.pack_to_int32(torch.from_numpy(zp), bits, packed_dim=0).numpy()
    zz = 0 if zp is None else np.repeat(zp.astype(np.float64), g, 1)
    expect = ((q - zz) * np.repeat(s.astype(np.float64), g, 1)).T
    return packed, s, pzp, zp, expect


@pytest.mark.parametrize("bits", [4, 8, 3])
@pytest.mark.parametrize("asym", [False, True])
def test_compressed_tensors_pack_quantized(bits, asym):
    rng = np.random.default_rng(bits * 2 + asym)
    packed, s, pzp, zp, expect = _ct_layer(bits, asym, rng)
    got = compressed.dequantize(packed, s, (24, 64), bits, pzp, 16)
    np.testing.assert_allclose(got, expect, rtol=0, atol=1e-12)
    if zp is not None:  # the zero point before packing, as the library holds it while quantizing
        np.testing.assert_allclose(compressed.dequantize(packed, s, (24, 64), bits, zp, 16), expect, atol=1e-12)
    t = {"weight_packed": packed, "weight_scale": s, "weight_shape": np.array([24, 64])}
    if pzp is not None:
        t["weight_zero_point"] = pzp
    meta = {"K": 64, "group_size": 16, "bits": bits}
    assert LAYOUTS["ct-pack-quantized"].can_take(t, meta) == ""
    np.testing.assert_allclose(LAYOUTS["ct-pack-quantized"].weight_kn(t, meta), expect, atol=1e-12)


def test_compressed_tensors_library_compressor_agrees():
    """The library's own compressor writes the tensors; our decoder reads the library's weight."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import compress_module
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)

    rng = np.random.default_rng(5)
    n, k, g = 16, 64, 32
    q = rng.integers(-8, 8, (n, k))
    s = rng.random((n, k // g)).astype(np.float32) * 0.02 + 0.005
    w = torch.from_numpy((q * np.repeat(s, g, 1)).astype(np.float32))
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=g))
    holder = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False))
    apply_quantization_config(holder, QuantizationConfig(config_groups={"g": scheme}, format="pack-quantized"))
    lin = holder[0]
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.weight_scale.copy_(torch.from_numpy(s))
    compress_module(lin)
    got = compressed.dequantize(lin.weight_packed.numpy(), lin.weight_scale.detach().numpy(),
                                tuple(lin.weight_shape.tolist()), 4, None, g)
    np.testing.assert_allclose(got.T, w.numpy(), rtol=0, atol=1e-7)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_codec_matches_torch(dtype):
    torch = pytest.importorskip("torch")
    tdt = getattr(torch, dtype)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ref = codes.view(tdt).double().numpy()
    np.testing.assert_array_equal(fp8.decode_fp8(codes.numpy(), dtype), ref)
    x = np.random.default_rng(0).normal(scale=fp8.FP8_MAX[dtype] / 4, size=4096)
    cast = torch.from_numpy(x).float().clamp(-fp8.FP8_MAX[dtype], fp8.FP8_MAX[dtype]).to(tdt)
    np.testing.assert_array_equal(fp8.quantize_fp8(x.astype(np.float32).astype(np.float64), dtype),
                                  cast.double().numpy())
    bits = fp8.encode_fp8(cast.double().numpy(), dtype)
    np.testing.assert_array_equal(bits, cast.view(torch.uint8).numpy())


def test_bf16_decode():
    # 0x3F80 = 1.0, 0xC000 = -2.0, 0x7F80 = inf (bfloat16 is the top half of a float32)
    np.testing.assert_array_equal(fp8.decode_bf16(np.array([0x3F80, 0xC000, 0x7F80], np.uint16)),
                                  np.array([1.0, -2.0, np.inf], np.float32))


@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
def test_fp8_scales(kind):
    rng = np.random.default_rng(3)
    n, k = 6, 10
    bits = rng.integers(0, 0x7E, (n, k)).astype(np.uint8)  # positive finite e4m3 codes
    vals = fp8.decode_fp8(bits)
    if kind == "tensor":
        scale, full, block = np.array([0.5]), np.full((n, k), 0.5), None
    elif kind == "channel":
        scale = rng.random(n) + 0.1
        full, block = np.repeat(scale[:, None], k, 1), None
    else:  # blocks of [4, 4]: a [2, 3] grid, the last row and column partial
        scale, block = rng.random((2, 3)) + 0.1, (4, 4)
        full = np.array([[scale[i // 4, j // 4] for j in range(k)] for i in range(n)])
    np.testing.assert_array_equal(fp8.dequantize_fp8(bits, scale, block=block), (vals * full).T)
    t = {"weight": bits, "weight_scale": scale}
    meta = {"K": k, "weight_block_size": list(block) if block else None}
    assert LAYOUTS["fp8"].can_take(t, meta) == ""
    assert fp8.scale_kind(scale.shape, n, k, block) == kind


def test_vllm_cpu_repack_by_hand():
    """vLLM's _process_gptq_weights_w4a16: codes packed along N into [K, N/8] words, then per
    block of 16 columns the K rows of its 2 words laid end to end: [N/16, 2K]."""
    rng = np.random.default_rng(4)
    k, n, g = 32, 32, 16
    q = rng.integers(0, 16, (k, n))
    words = np.array([[_word(q[r, 8 * c: 8 * c + 8]) for c in range(n // 8)] for r in range(k)], np.int32)
    repacked = np.array([[words[i // 2, 2 * b + i % 2] for i in range(2 * k)] for b in range(n // 16)], np.int32)
    np.testing.assert_array_equal(vllm_cpu.repack(q), repacked)
    np.testing.assert_array_equal(vllm_cpu.unrepack(repacked, k), q)
    s = (rng.random((k // g, n)) + 0.5).astype(np.float32)
    z = rng.integers(0, 16, (k // g, n))
    qz = np.array([[_word(z[r, 8 * c: 8 * c + 8]) for c in range(n // 8)] for r in range(k // g)], np.int32)
    gi = np.arange(k) // g
    np.testing.assert_array_equal(vllm_cpu.dequantize(repacked, s, k, qz, g), (q - z[gi]) * s[gi])
    np.testing.assert_array_equal(vllm_cpu.dequantize(repacked, s, k, None, g), (q - 8.0) * s[gi])
    t, meta = {"qweight": repacked, "scales": s, "qzeros": qz}, {"K": k, "group_size": g}
    assert LAYOUTS["vllm-cpu-w4a16"].can_take(t, meta) == ""
