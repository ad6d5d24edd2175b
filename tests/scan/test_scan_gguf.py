"""GGUF scans: the real SmolLM2 Q4_1 file, corrupted copies of it, and synthetic block files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from qforensics.scan import scan_path
from qforensics.scan.gguf_file import BLOCK_LAYOUTS

TARGET = "blk.3.ffn_up.weight"  # a Q4_1 tensor of the real model


def _corrupt_copy(src: Path, dst: Path, info, blocks: range, field_offset: int,
                  value: float) -> Path:
    shutil.copyfile(src, dst)
    block_bytes = BLOCK_LAYOUTS[info.type][0]
    with open(dst, "r+b") as fh:
        for b in blocks:
            fh.seek(info.offset + b * block_bytes + field_offset)
            fh.write(np.float16(value).astype("<f2").tobytes())
    return dst


def test_real_gguf_scans_clean(cli, real_gguf):
    result = cli(real_gguf)
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1] == "PASSED | scanned 272 tensors in 1 file"


def test_real_gguf_nan_block_scale_is_caught(cli, real_gguf, real_gguf_tensors, tmp_path):
    info = real_gguf_tensors[TARGET]
    assert info.type == "Q4_1"
    bad = _corrupt_copy(real_gguf, tmp_path / "nan.gguf", info, range(1234, 1235), 0, np.nan)
    result = cli(bad, "--json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["verdict"] == "failed"
    [f] = doc["findings"]
    assert (f["tensor"], f["check"], f["severity"]) == (TARGET, "nan", "error")
    assert (f["block_index"], f["first_index"], f["count"]) == (1234, 1234 * 32, 1)
    assert f["example"] == "nan"
    blocks_per_row = info.ne[0] // 32
    assert f"block 1234 (row {1234 // blocks_per_row}, flat index {1234 * 32})" in f["message"]

    human = cli(bad)
    assert human.exit_code == 1
    assert f"ERROR nan | nan.gguf | {TARGET} | 1 of " in human.output
    assert "Q4_1 block scales 'd' are NaN; first at block 1234" in human.output
    assert human.output.strip().splitlines()[-1].startswith(
        "FAILED | 1 finding in 1 file (1 error); scanned 272 tensors in 1 file")


def test_real_gguf_group_of_zero_scales_is_caught(cli, real_gguf, real_gguf_tensors, tmp_path):
    info = real_gguf_tensors[TARGET]
    bad = _corrupt_copy(real_gguf, tmp_path / "zero.gguf", info, range(640, 648), 0, 0.0)
    result = cli(bad)
    assert result.exit_code == 1
    assert (f"WARNING zero_scale | zero.gguf | {TARGET} | 8 of " in result.output)
    assert "are zero; first at block 640" in result.output
    # the same copy passes when only errors fail the scan
    lenient = cli(bad, "--fail-on", "error")
    assert lenient.exit_code == 0
    assert lenient.output.strip().splitlines()[-1].startswith("PASSED | scanned 272 tensors")


def _write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType | None]]):
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (arr, qtype) in tensors.items():
        if qtype is None:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, arr, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _blocks(qtype: str, n_blocks: int, seed: int = 0) -> np.ndarray:
    """Random block bytes with every scale field set to a finite, normal half float."""
    block_bytes, _, fields = BLOCK_LAYOUTS[qtype]
    b = np.random.default_rng(seed).integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for fld in fields:
        b[:, fld.offset: fld.offset + 2] = np.frombuffer(
            np.float16(0.5 if fld.is_multiplier else 0.25).astype("<f2").tobytes(), np.uint8)
    return b


@pytest.mark.parametrize("qtype", sorted(BLOCK_LAYOUTS))
def test_block_layout_offsets_match_gguf_dequantize(qtype, tmp_path):
    """Each field offset is where ggml keeps it: a NaN there poisons exactly that block."""
    block_bytes, block_elems, fields = BLOCK_LAYOUTS[qtype]
    assert gguf.GGML_QUANT_SIZES[GGMLQuantizationType[qtype]] == (block_elems, block_bytes)
    rows, per_row = 3, 2
    for fld in fields:
        blocks = _blocks(qtype, rows * per_row)
        blocks[3, fld.offset: fld.offset + 2] = np.frombuffer(
            np.float16(np.nan).astype("<f2").tobytes(), np.uint8)
        data = blocks.reshape(rows, per_row * block_bytes)
        deq = gguf.quants.dequantize(data, GGMLQuantizationType[qtype]).reshape(-1, block_elems)
        assert np.isnan(deq[3]).all() and not np.isnan(np.delete(deq, 3, axis=0)).any()

        path = _write_gguf(tmp_path / f"{qtype}_{fld.name}.gguf",
                           {"w": (data, GGMLQuantizationType[qtype])})
        report = scan_path(path, chunk_bytes=2 * block_bytes)  # chunks of 2 blocks
        [f] = report.findings
        assert (f.check, f.block_index, f.first_index, f.count) == ("nan", 3, 3 * block_elems, 1)
        assert f"'{fld.name}'" in f.message and "row 1" in f.message


def test_synthetic_gguf_float_and_unsupported_types(tmp_path):
    f32 = np.ones((4, 8), dtype=np.float32)
    f32[2, 5] = -np.inf
    iq = np.zeros((2, 18), dtype=np.uint8)  # IQ4_NL: same size as Q4_0, not checked
    path = _write_gguf(tmp_path / "mix.gguf", {
        "ok.weight": (_blocks("Q8_0", 4).reshape(2, 2 * 34), GGMLQuantizationType.Q8_0),
        "f.weight": (f32, None),
        "iq.weight": (iq, GGMLQuantizationType.IQ4_NL),
    })
    report = scan_path(path)
    assert [(f.tensor, f.check, f.first_index, f.example) for f in report.findings] == [
        ("f.weight", "inf", 2 * 8 + 5, -np.inf)]
    assert [(s.tensor, s.reason) for s in report.skipped] == [
        ("iq.weight", "not checked (type IQ4_NL)")]
    assert report.tensors_scanned == 2


def test_not_a_gguf_exits_2(cli, tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    result = cli(bad)
    assert result.exit_code == 2
    assert "malformed or unsupported GGUF file" in result.output
