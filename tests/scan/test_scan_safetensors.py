"""Safetensors files and Hugging Face folders: AWQ, GPTQ, FP8, plain, pickles, malformed headers."""

from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from qforensics.errors import ScanError
from qforensics.scan import scan_path
from qforensics.scan.dtypes import E4M3_TABLE, E5M2_TABLE, E8M0_TABLE, FLOAT_FORMATS
from qforensics.scan.safetensors_file import SafetensorsFile

SCALES = "model.layers.0.mlp.down_proj.scales"
QWEIGHT = "model.layers.0.mlp.down_proj.qweight"


def last_line(result) -> str:
    return result.output.strip().splitlines()[-1]


# -- AWQ -------------------------------------------------------------------------------------


def test_awq_good_passes(cli, kit, tmp_path):
    d = kit.model_dir(tmp_path, kit.awq_tensors(), kit.AWQ_CONFIG)
    result = cli(d)
    assert result.exit_code == 0, result.output
    assert last_line(result) == "PASSED | scanned 4 tensors in 1 file"
    doc = json.loads(cli(d, "--json").stdout)
    assert doc["files"] == [{"file": "model.safetensors", "format": "safetensors",
                             "layout": "awq", "tensors": 4,
                             "bytes": (d / "model.safetensors").stat().st_size}]


def test_awq_layout_detected_without_config(kit, tmp_path):
    d = kit.model_dir(tmp_path, kit.awq_tensors(), None)
    report = scan_path(d)
    assert report.findings == [] and report.files[0].layout == "awq"


def test_awq_nan_scale(cli, kit, tmp_path):
    t = kit.awq_tensors()
    t[SCALES][1, 5] = np.nan
    t[SCALES][1, 9] = np.nan
    d = kit.model_dir(tmp_path, t, kit.AWQ_CONFIG)
    result = cli(d)
    assert result.exit_code == 1
    assert (f"ERROR nan | model.safetensors | {SCALES} | 2 of {2 * kit.N} values are NaN; "
            f"first at flat index {kit.N + 5}, value nan") in result.output
    assert last_line(result).startswith("FAILED | 1 finding in 1 file (1 error)")


def test_awq_qweight_rows_do_not_match_group_size(cli, kit, tmp_path):
    t = kit.awq_tensors()
    t[QWEIGHT] = t[QWEIGHT][:200]  # K = 200 is not a multiple of G = 128
    d = kit.model_dir(tmp_path, t, kit.AWQ_CONFIG)
    result = cli(d)
    assert result.exit_code == 1
    assert (f"ERROR shape | model.safetensors | {QWEIGHT} | qweight [200, 8] has K = 200 input "
            f"rows, not a multiple of group size 128") in result.output


def test_awq_qweight_rows_give_wrong_group_count(kit, tmp_path):
    t = kit.awq_tensors()
    t[QWEIGHT] = np.zeros((384, kit.N // 8), dtype=np.int32)  # K/G = 3, scales has 2 groups
    [f] = scan_path(kit.model_dir(tmp_path, t, kit.AWQ_CONFIG)).findings
    assert (f.check, f.tensor) == ("shape", QWEIGHT)
    assert "scales [2, 64] has 2 groups but K = 384 with group size 128 needs 3" in f.message


def test_awq_qzeros_and_packing_mismatch(kit, tmp_path):
    t = kit.awq_tensors()
    t["model.layers.0.mlp.down_proj.qzeros"] = np.zeros((2, 4), dtype=np.int32)
    [f] = scan_path(kit.model_dir(tmp_path, t, kit.AWQ_CONFIG)).findings
    assert f.check == "shape" and "qzeros [2, 4] does not match [K/G, N/8] = [2, 8]" in f.message

    t = kit.awq_tensors()
    t[QWEIGHT] = np.zeros((kit.K, 4), dtype=np.int32)  # packs 32 columns, scales has 64
    [f] = scan_path(kit.model_dir(tmp_path, t, kit.AWQ_CONFIG, name="m2")).findings
    assert f.check == "shape" and "packs 4 x 8 = 32 output columns" in f.message


def test_awq_missing_scales_and_wrong_dtype(kit, tmp_path):
    t = kit.awq_tensors()
    del t[SCALES]
    [f] = scan_path(kit.model_dir(tmp_path, t, kit.AWQ_CONFIG)).findings
    assert (f.check, f.tensor) == ("missing_tensor", QWEIGHT)

    t = kit.awq_tensors()
    t[QWEIGHT] = t[QWEIGHT].astype(np.float32)
    [f] = scan_path(kit.model_dir(tmp_path, t, kit.AWQ_CONFIG, name="m2")).findings
    assert f.check == "dtype" and "qweight is F32" in f.message


def test_scales_split_across_shards(kit, tmp_path):
    """A sharded checkpoint: structure is checked across files of one folder."""
    d = tmp_path / "sharded"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"quantization_config": kit.AWQ_CONFIG}))
    t = kit.awq_tensors()
    kit.write_safetensors(d / "model-00001-of-00002.safetensors", {QWEIGHT: t[QWEIGHT]})
    rest = {k: v for k, v in t.items() if k != QWEIGHT}
    rest[SCALES] = rest[SCALES][:1]  # one group only: K/G = 2 expected
    kit.write_safetensors(d / "model-00002-of-00002.safetensors", rest)
    index = {"weight_map": {QWEIGHT: "model-00001-of-00002.safetensors",
                            SCALES: "model-00002-of-00002.safetensors",
                            "x": "model-00003-of-00003.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    report = scan_path(d)
    checks = sorted((f.check, f.file) for f in report.findings)
    assert checks == [("missing_file", "model.safetensors.index.json"),
                      ("shape", "model-00001-of-00002.safetensors"),
                      ("shape", "model-00002-of-00002.safetensors")]
    # one shard alone: its companions may be elsewhere, so nothing is "missing"
    alone = scan_path(d / "model-00001-of-00002.safetensors")
    assert alone.findings == []


# -- GPTQ ------------------------------------------------------------------------------------


def test_gptq_good_passes(kit, tmp_path):
    report = scan_path(kit.model_dir(tmp_path, kit.gptq_tensors(), kit.GPTQ_CONFIG))
    assert report.findings == [] and report.verdict() == "passed"
    assert report.files[0].layout == "gptq"


def test_gptq_g_idx_out_of_range(cli, kit, tmp_path):
    t = kit.gptq_tensors()
    g_idx = "model.layers.0.self_attn.q_proj.g_idx"
    t[g_idx][[7, 100]] = [2, 5]  # only groups 0 and 1 exist
    d = kit.model_dir(tmp_path, t, kit.GPTQ_CONFIG)
    result = cli(d)
    assert result.exit_code == 1
    assert (f"ERROR g_idx_range | model.safetensors | {g_idx} | 2 of {kit.K} g_idx values fall "
            f"outside [0, 2); first at flat index 7, value 2") in result.output
    [f] = json.loads(cli(d, "--json").stdout)["findings"]
    assert (f["count"], f["first_index"], f["example"], f["total"]) == (2, 7, 2, kit.K)


def test_gptq_v1_zero_point_wrap_and_sym(kit, tmp_path):
    qz = "model.layers.0.self_attn.q_proj.qzeros"
    t = kit.gptq_tensors()
    t[qz][0, 0] = 0x7777F777  # nibble 3 holds 15: z - 1 with z = 0 wrapped
    asym = dict(kit.GPTQ_CONFIG, sym=False)
    [f] = scan_path(kit.model_dir(tmp_path, t, asym)).findings
    assert (f.check, f.tensor, f.first_index, f.example) == ("zero_point_wrap", qz, 3, 15)
    [f] = scan_path(kit.model_dir(tmp_path, t, kit.GPTQ_CONFIG, name="sym")).findings
    assert (f.check, f.count, f.example) == ("zero_point_sym", 1, 15)
    # v2 stores z itself: the symmetric midpoint is 8, so 0x77777777 is wrong everywhere
    v2 = dict(kit.GPTQ_CONFIG, checkpoint_format="gptq_v2")
    [f] = scan_path(kit.model_dir(tmp_path, kit.gptq_tensors(), v2, name="v2")).findings
    assert (f.check, f.count) == ("zero_point_sym", 2 * kit.N)


# -- FP8 and float scales ----------------------------------------------------------------


def test_fp8_weight_scale_inf(cli, kit, tmp_path):
    rng = np.random.default_rng(0)
    w = rng.integers(0, 0x7E, size=(16, 32), dtype=np.uint8)  # finite positive e4m3 codes
    tensors = {
        "model.layers.0.mlp.up_proj.weight": kit.raw("F8_E4M3", (16, 32), w.tobytes()),
        "model.layers.0.mlp.up_proj.weight_scale": np.array([np.inf], dtype=np.float32),
        "model.layers.0.mlp.up_proj.input_scale": np.array([0.02], dtype=np.float32),
    }
    d = kit.model_dir(tmp_path, tensors, {"quant_method": "fp8", "activation_scheme": "static"})
    result = cli(d)
    assert result.exit_code == 1
    assert ("ERROR inf | model.safetensors | model.layers.0.mlp.up_proj.weight_scale | 1 of 1 "
            "values are +/-Inf; first at flat index 0, value inf") in result.output
    assert json.loads(cli(d, "--json").stdout)["files"][0]["layout"] == "fp8"


def test_fp8_weight_nan_code_and_block_scale_shape(kit, tmp_path):
    w = np.full((256, 128), 0x38, dtype=np.uint8)  # 1.0
    w[3, 4] = 0xFF  # e4m3 NaN
    tensors = {
        "l.weight": kit.raw("F8_E4M3", (256, 128), w.tobytes()),
        "l.weight_scale_inv": np.ones((2, 2), dtype=np.float32),  # [256/128, 128/128] = [2, 1]
    }
    cfg = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    report = scan_path(kit.model_dir(tmp_path, tensors, cfg))
    by_check = {f.check: f for f in report.findings}
    assert set(by_check) == {"nan", "shape"}
    assert by_check["nan"].first_index == 3 * 128 + 4
    assert "expected [2, 1]" in by_check["shape"].message


def test_fp32_scale_overflows_fp16(cli, kit, tmp_path):
    t = kit.awq_tensors()
    t[SCALES] = t[SCALES].astype(np.float32)
    t[SCALES][0, 3] = 1e6
    d = kit.model_dir(tmp_path, t, kit.AWQ_CONFIG)
    result = cli(d)
    assert result.exit_code == 1
    assert (f"ERROR fp16_overflow | model.safetensors | {SCALES} | 1 of {2 * kit.N} values exceed "
            f"the FP16 range (|s| > 65504; inf once cast to FP16); first at flat index 3, "
            f"value 1e+06") in result.output


def test_bf16_zero_and_subnormal_scales(kit, tmp_path):
    s = np.full(8, 0.01, dtype=np.float32)
    s[2] = 0.0
    s[5] = 1e-39  # float32/bf16 subnormal
    path = kit.write_safetensors(tmp_path / "m.safetensors", {
        "a.weight_scale": kit.raw("BF16", (8,), kit.bf16_bytes(s))})
    report = scan_path(path)
    assert [(f.check, f.severity, f.first_index) for f in report.findings] == [
        ("zero_scale", "warning", 2), ("subnormal_scale", "warning", 5)]
    assert report.verdict("error") == "passed" and report.verdict() == "failed"


def test_plain_weights_nan_inf_and_chunking(kit, tmp_path):
    """Ordinary weights: only NaN/Inf. Results do not depend on the chunk size."""
    w = np.zeros((64, 33), dtype=np.float16)  # zeros in a weight are fine
    w.flat[[100, 2000]] = np.nan
    w.flat[1500] = -np.inf
    path = kit.write_safetensors(tmp_path / "p.safetensors", {"x.weight": w})
    big = scan_path(path)
    small = scan_path(path, chunk_bytes=64)  # 16 elements per chunk
    assert [f.to_dict() for f in big.findings] == [f.to_dict() for f in small.findings]
    assert [(f.check, f.count, f.first_index) for f in big.findings] == [
        ("nan", 2, 100), ("inf", 1, 1500)]
    assert big.files[0].layout == "plain"


# -- pickles, malformed files, CLI details -------------------------------------------------


class _Bomb:
    """Unpickling this touches a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickle_files_are_never_opened(cli, kit, tmp_path, monkeypatch):
    marker = tmp_path / "unpickled"
    d = kit.model_dir(tmp_path, kit.awq_tensors(), kit.AWQ_CONFIG)
    (d / "pytorch_model.bin").write_bytes(pickle.dumps(_Bomb(marker)))
    (d / "optimizer.pt").write_bytes(pickle.dumps(_Bomb(marker)))

    def refuse(*a, **k):
        raise AssertionError("the scanner must never unpickle")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    real_open = open

    def guarded_open(file, *a, **k):
        assert Path(str(file)).suffix not in {".bin", ".pt"}, f"opened {file}"
        return real_open(file, *a, **k)

    monkeypatch.setattr("builtins.open", guarded_open)
    result = cli(d)
    assert result.exit_code == 0, result.output
    assert "NOT SCANNED | optimizer.pt | not scanned (pickle)" in result.output
    assert "NOT SCANNED | pytorch_model.bin | not scanned (pickle)" in result.output
    assert last_line(result) == ("PASSED | scanned 4 tensors in 1 file "
                                 "(2 pickle files not scanned)")

    only = cli(d / "pytorch_model.bin")
    assert only.exit_code == 2
    assert "NOT SCANNED | pytorch_model.bin" in only.output
    assert "nothing scanned" in only.output
    assert not marker.exists()


def _malformed(kit, tmp_path: Path) -> dict[str, Path]:
    t = tmp_path
    ok = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    return {
        "short": (t / "short.safetensors", b"\x01\x02"),
        "length beyond file": kit.write_raw_header(t / "len.safetensors", {"a": ok}, b"\0" * 16,
                                                   length=10**6),
        "not json": kit.write_raw_header(t / "json.safetensors", b"{not json", b""),
        "unknown dtype": kit.write_raw_header(t / "dt.safetensors", {"a": dict(ok, dtype="Q7")},
                                              b"\0" * 16),
        "offsets outside": kit.write_raw_header(
            t / "off.safetensors", {"a": dict(ok, data_offsets=[0, 32])}, b"\0" * 16),
        "size mismatch": kit.write_raw_header(
            t / "size.safetensors", {"a": dict(ok, shape=[3, 2])}, b"\0" * 16),
        "bad shape": kit.write_raw_header(
            t / "shape.safetensors", {"a": dict(ok, shape=[2, -2])}, b"\0" * 16),
        "overlap": kit.write_raw_header(
            t / "ovl.safetensors", {"a": ok, "b": dict(ok, data_offsets=[8, 24])}, b"\0" * 24),
    }


@pytest.mark.parametrize("case, needle", [
    ("short", "shorter than the 8-byte header length"),
    ("length beyond file", "header length 1000000 exceeds the file size"),
    ("not json", "header is not valid UTF-8 JSON"),
    ("unknown dtype", "tensor 'a': unknown dtype 'Q7'"),
    ("offsets outside", "data_offsets [0, 32] fall outside the 16-byte data section"),
    ("size mismatch", "shape [3, 2] x F32 needs 24 bytes but data_offsets span 16"),
    ("bad shape", "is not a list of non-negative integers"),
    ("overlap", "tensors 'a' and 'b' overlap"),
])
def test_malformed_safetensors_header(kit, tmp_path, case, needle):
    spec = _malformed(kit, tmp_path)[case]
    if isinstance(spec, tuple):
        spec[0].write_bytes(spec[1])
        spec = spec[0]
    with pytest.raises(ScanError, match="malformed safetensors file") as exc:
        SafetensorsFile(spec)
    assert needle in str(exc.value)


def test_malformed_header_exits_2(cli, kit, tmp_path):
    path = kit.write_raw_header(tmp_path / "bad.safetensors",
                                {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 999]}},
                                b"\0" * 16)
    result = cli(path)
    assert result.exit_code == 2
    assert result.output.startswith(f"Error: {path}: malformed safetensors file: tensor 'a'")
    assert "Traceback" not in result.output


def test_bad_usage_exits_2(cli, tmp_path):
    assert cli(tmp_path / "missing").exit_code == 2
    (tmp_path / "notes.txt").write_text("hi")
    result = cli(tmp_path / "notes.txt")
    assert result.exit_code == 2 and "not a checkpoint this scanner reads" in result.output
    empty = tmp_path / "empty"
    empty.mkdir()
    result = cli(empty)
    assert result.exit_code == 2 and "no .safetensors, .gguf or pickle" in result.output


def test_json_schema_and_help(cli, kit, tmp_path):
    t = kit.awq_tensors()
    t[SCALES][0, 0] = np.nan
    doc = json.loads(cli(kit.model_dir(tmp_path, t, kit.AWQ_CONFIG), "--json").stdout)
    assert (doc["schema"], doc["version"], doc["verdict"]) == ("qforensics.scan", "1.0", "failed")
    assert doc["counts"] == {"error": 1, "warning": 0}
    assert set(doc["findings"][0]) == {"file", "tensor", "check", "severity", "count",
                                       "first_index", "block_index", "example", "total",
                                       "message"}
    assert doc["findings"][0]["example"] == "nan"

    help_text = cli("--help").output
    tail = help_text.strip().splitlines()
    at = max(i for i, line in enumerate(tail) if "Example:" in line)
    assert tail[at + 1:] and all(ln.strip().startswith("qforensics scan") for ln in tail[at + 1:])


def test_progress_bar_goes_to_stderr(cli, kit, tmp_path):
    d = kit.model_dir(tmp_path, kit.awq_tensors(), kit.AWQ_CONFIG)
    result = cli(d, "--progress", "--json")
    assert result.exit_code == 0
    assert "scanning" in result.stderr and "scanning" not in result.stdout
    json.loads(result.stdout)
    quiet = cli(d)  # not a TTY: no bar by default
    assert "scanning" not in quiet.stderr


def test_scan_does_not_import_torch(kit, tmp_path):
    import subprocess
    import sys

    d = kit.model_dir(tmp_path, kit.awq_tensors(), kit.AWQ_CONFIG)
    code = ("import sys\nfrom click.testing import CliRunner\nfrom qforensics.cli import main\n"
            f"r = CliRunner().invoke(main, ['scan', {str(d)!r}])\n"
            "assert r.exit_code == 0, r.output\nassert 'torch' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- decoders ----------------------------------------------------------------------------


def test_fp8_tables_known_values():
    assert E4M3_TABLE[0x38] == 1.0 and E4M3_TABLE[0x7E] == 448.0 and E4M3_TABLE[0xFE] == -448.0
    assert E4M3_TABLE[0x01] == 2.0**-9 and np.isnan(E4M3_TABLE[[0x7F, 0xFF]]).all()
    assert np.isfinite(np.delete(E4M3_TABLE, [0x7F, 0xFF])).all()
    assert E5M2_TABLE[0x3C] == 1.0 and E5M2_TABLE[0x7B] == 57344.0 and E5M2_TABLE[0x01] == 2.0**-16
    assert E5M2_TABLE[0x7C] == np.inf and E5M2_TABLE[0xFC] == -np.inf
    assert np.isnan(E5M2_TABLE[[0x7D, 0x7E, 0x7F, 0xFD]]).all()
    assert E8M0_TABLE[127] == 1.0 and np.isnan(E8M0_TABLE[255])
    for name in ("F8_E4M3", "F8_E5M2", "F8_E8M0"):
        fmt = FLOAT_FORMATS[name]
        codes = np.arange(256, dtype=np.uint8)
        assert (fmt.nonfinite(codes) == ~np.isfinite(fmt.decode(codes))).all()


def test_fp8_tables_match_torch():
    torch = pytest.importorskip("torch")
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for table, dt in ((E4M3_TABLE, "float8_e4m3fn"), (E5M2_TABLE, "float8_e5m2"),
                      (E8M0_TABLE, "float8_e8m0fnu")):
        if not hasattr(torch, dt):
            continue
        ref = codes.view(getattr(torch, dt)).float().numpy()
        np.testing.assert_array_equal(table, ref)


def test_bf16_and_f16_raw_checks_match_numpy():
    rng = np.random.default_rng(1)
    u16 = rng.integers(0, 2**16, size=50_000, dtype=np.uint16)
    for name in ("F16", "BF16"):
        fmt = FLOAT_FORMATS[name]
        vals = fmt.decode(u16)
        assert (fmt.nonfinite(u16) == ~np.isfinite(vals)).all()
    bf = FLOAT_FORMATS["BF16"].decode(np.array([0x3F80, 0xC000, 0x7F80], dtype=np.uint16))
    assert bf.tolist() == [1.0, -2.0, np.inf]
    assert struct.pack("<f", 1.0)[2:] == np.uint16(0x3F80).tobytes()


def test_every_check_is_documented():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "scan.md").read_text()
    from qforensics.scan import CHECKS

    for check, (severity, _) in CHECKS.items():
        assert f"| `{check}` | {severity} |" in doc, check


def test_deeply_nested_header_is_malformed_not_a_crash(tmp_path):
    raw = ("[" * 100_000 + "]" * 100_000).encode()
    path = tmp_path / "deep.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw)
    with pytest.raises(ScanError, match="header is not valid UTF-8 JSON"):
        SafetensorsFile(path)
