"""`qforensics analyze` / `qforensics diff` through click: exit codes, key lines, JSON, help."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
from analyze_synth import make_trace

from qforensics.cli import main


def _nan_at(step, layer, module):
    def t(s, l, m, st, x):
        if (s, l, m, st) == (step, layer, module, "out"):
            x = x.copy()
            x[0, 0] = np.nan
        return x
    return t


def test_analyze_failed_exit_1(tmp_path, runner):
    p = make_trace(str(tmp_path / "t.h5"), 3, tamper=_nan_at(1, 1, "mlp.down_proj"))
    r = runner.invoke(main, ["analyze", p])
    assert r.exit_code == 1, r.output
    lines = r.output.splitlines()
    assert lines[0] == ("FAILED | first non-finite at step 1, call 24: "
                        "model.layers.1.mlp.down_proj produced NaN from finite input")
    assert "First non-finite value" in r.output and "producer: model.layers.1.mlp.down_proj" in \
        r.output
    assert "Predicted damage to linear inputs (step 1" in r.output
    assert max(len(x) for x in lines[1:]) <= 100  # the verdict line stays one line


def test_analyze_passed_exit_0_and_json(tmp_path, runner):
    p = make_trace(str(tmp_path / "t.h5"), 3)
    r = runner.invoke(main, ["analyze", p])
    assert r.exit_code == 0 and r.output.startswith("PASSED | no non-finite values in 3 steps")
    r = runner.invoke(main, ["analyze", p, "--json", "--top", "2"])
    assert r.exit_code == 0
    d = json.loads(r.output)
    assert d["schema"] == "qforensics.analyze" and d["verdict"]["status"] == "PASSED"
    assert d["thresholds"]["top"] == 2 and d["first_nonfinite"] is None


def test_analyze_multi_rank_glob(tmp_path, runner):
    make_trace(str(tmp_path / "trace-0.h5"), 3, environment={"rank": 0, "world_size": 2})
    make_trace(str(tmp_path / "trace-1.h5"), 3, environment={"rank": 1, "world_size": 2},
               tamper=_nan_at(2, 0, "self_attn.q_proj"))
    r = runner.invoke(main, ["analyze", str(tmp_path / "trace-*.h5")])
    assert r.exit_code == 1, r.output
    assert r.output.startswith("FAILED | earliest failure on rank 1 of 2")
    assert "  rank 0: PASSED | no non-finite values in 3 steps" in r.output
    assert "== rank 1:" in r.output


def test_analyze_bad_input_exit_2(tmp_path, runner):
    bad = tmp_path / "x.h5"
    bad.write_bytes(b"junk")
    r = runner.invoke(main, ["analyze", str(bad)])
    assert r.exit_code == 2 and "not an HDF5 file" in r.output
    r = runner.invoke(main, ["analyze", str(tmp_path / "missing.h5")])
    assert r.exit_code == 2 and "no such file" in r.output
    r = runner.invoke(main, ["analyze", str(tmp_path / "none-*.h5")])
    assert r.exit_code == 2
    r = runner.invoke(main, ["analyze", "--ratio", "-1", str(bad)])
    assert r.exit_code == 2


def test_help_shows_defaults_and_example(runner):
    for cmd in ("analyze", "diff"):
        r = runner.invoke(main, [cmd, "--help"])
        assert r.exit_code == 0
        assert "[default:" in r.output
        assert "Example:" in [x.strip() for x in r.output.rstrip().splitlines()[-6:]]
    r = runner.invoke(main, ["analyze", "--help"])
    flat = " ".join(r.output.split())
    assert "[default: 20.0" in flat and "[default: 100.0" in flat


def test_diff_same_and_divergent(tmp_path, runner):
    ref = make_trace(str(tmp_path / "ref.h5"), 2)
    same = make_trace(str(tmp_path / "same.h5"), 2)
    r = runner.invoke(main, ["diff", ref, same])
    assert r.exit_code == 0, r.output
    assert r.output.startswith("PASSED | no module adds divergence >= 0.3")

    def broken(s, l, m, st, x):  # layer 1 up_proj output scaled: it alone adds divergence
        return x * 3.0 if (l, m, st) == (1, "mlp.up_proj", "out") else x
    sus = make_trace(str(tmp_path / "sus.h5"), 2, tamper=broken)
    r = runner.invoke(main, ["diff", ref, sus, "--json"])
    assert r.exit_code == 1
    d = json.loads(r.output)
    assert d["schema"] == "qforensics.diff"
    assert d["first_jump"]["module"] == "model.layers.1.mlp.up_proj"
    assert d["ranked"][0]["module"] == "model.layers.1.mlp.up_proj"
    assert d["first_jump"]["call_index"] == 7
    nan = make_trace(str(tmp_path / "nan.h5"), 2, tamper=_nan_at(0, 2, "mlp.down_proj"))
    r = runner.invoke(main, ["diff", ref, nan])
    assert r.exit_code == 1 and r.output.startswith(
        "FAILED | the suspect first holds NaN/Inf where the reference is finite at step 0, "
        "call 13: model.layers.2.mlp.down_proj (output)")


def test_analyze_never_imports_torch(tmp_path):
    p = make_trace(str(tmp_path / "t.h5"), 2, tamper=_nan_at(0, 1, "mlp.down_proj"))
    code = (
        "import sys\n"
        "import qforensics.analyze\n"
        "from qforensics.cli import main\n"
        "try:\n"
        f"    main(['analyze', {p!r}])\n"
        "except SystemExit as e:\n"
        "    code = e.code\n"
        "try:\n"
        f"    main(['diff', {p!r}, {p!r}])\n"
        "except SystemExit:\n"
        "    pass\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "print('TORCH', bad, 'CODE', code)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                         timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                             os.path.abspath(__file__)))))
    assert "TORCH [] CODE 1" in out.stdout, out.stdout + out.stderr
