"""The sanitizer runner's exact command line and environment, verdicts, and the launcher entry point.

A stub executable written per test records its argv/env and prints a canned report.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from replay_helpers import make_awq
from test_replay_parse import DEMO, NO_GPU

from qforensics.errors import ReplayError
from qforensics.replay import sanitizer as san_mod
from qforensics.replay.build import build_bundle
from qforensics.replay.kernel import run_project_kernel
from qforensics.replay.parse import parse_sanitizer_output
from qforensics.replay.run import replay, sanitizer_leg
from qforensics.replay.sanitizer import find_sanitizer, run_sanitizer, sanitizer_command
from qforensics.replay.verdict import Verdict, judge_sanitizer

CANNED_OOB = """qforensics-replay: alloc x 0x7f0000000000 384
qforensics-replay: launch qf_awq_gemm_unchecked grid=(1,1,1) block=(256,1,1)
========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 16 bytes
=========     at qf_awq_gemm_unchecked+0x2d0 in awq_gemm.cu:94
=========     by thread (12,0,0) in block (0,0,0)
=========     Address 0x7f0000000180 is out of bounds
=========     and is 1 bytes after the nearest allocation at 0x7f0000000000 of size 384 bytes
=========
========= Program hit cudaErrorLaunchFailure (error 719) due to "unspecified launch failure" on CUDA API call to cudaDeviceSynchronize.
========= Target application returned an error
========= ERROR SUMMARY: 21 errors
"""

CANNED_CLEAN = """qforensics-replay: launch qf_awq_gemm_unchecked grid=(1,1,1) block=(256,1,1)
qforensics-replay: kernel-done qf_awq_gemm_unchecked
qforensics-replay: status ok
========= COMPUTE-SANITIZER
========= ERROR SUMMARY: 0 errors
"""


def make_stub(tmp_path: Path, canned: str, rc: int = 0, run_target: bool = False) -> tuple[Path, Path]:
    record = tmp_path / "stub-record.json"
    (tmp_path / "canned.txt").write_text(canned)
    stub = tmp_path / "compute-sanitizer"
    stub.write_text(f"""#!{sys.executable}
import json, os, subprocess, sys
json.dump({{"argv": sys.argv[1:], "env": dict(os.environ)}}, open({str(record)!r}, "w"))
if {run_target!r}:
    i = sys.argv.index("--print-limit") + 2
    while sys.argv[i].startswith("--"):
        i += 2
    p = subprocess.run(sys.argv[i:], capture_output=True, text=True)
    sys.stdout.write(p.stdout + p.stderr)
sys.stdout.write(open({str(tmp_path / 'canned.txt')!r}).read())
sys.exit({rc})
""")
    stub.chmod(0o755)
    return stub, record


def test_command_line_exact():
    assert sanitizer_command("/x/compute-sanitizer", ["/bin/prog", "dir"], kernel_name="qf_awq_gemm", padding=8192) == [
        "/x/compute-sanitizer", "--tool", "memcheck", "--kernel-name", "kns=qf_awq_gemm", "--error-exitcode", "86",
        "--print-limit", "100", "--padding", "8192", "/bin/prog", "dir"]
    assert sanitizer_command("cs", ["p"], tool="racecheck", kernel_name="regex=gemm.*", error_exitcode=3,
                             print_limit=0, padding=8192) == [
        "cs", "--tool", "racecheck", "--kernel-name", "regex=gemm.*", "--error-exitcode", "3", "--print-limit", "0", "p"]
    with pytest.raises(ReplayError, match="unknown sanitizer tool"):
        sanitizer_command("cs", ["p"], tool="leakcheck")


def test_stub_runs_the_target_with_exact_argv_and_env(tmp_path, monkeypatch):
    """The sanitizer stub really runs the target; the target itself reports the environment it got."""
    monkeypatch.setenv("KEEP_ME", "1")
    monkeypatch.delenv("PYTORCH_NO_CUDA_MEMORY_CACHING", raising=False)
    target = tmp_path / "target.py"
    target.write_text("import json, os, sys\n"
                      f"json.dump({{'argv': sys.argv[1:], 'env': dict(os.environ)}}, open({str(tmp_path / 'target.json')!r}, 'w'))\n")
    stub, record = make_stub(tmp_path, DEMO, rc=86, run_target=True)
    argv = sanitizer_command(stub, [sys.executable, str(target), "arg"], tool="initcheck", kernel_name="kns=k")
    run = run_sanitizer(argv, raw_path=tmp_path / "raw" / "out.txt")
    seen = json.loads(record.read_text())
    assert seen["argv"] == ["--tool", "initcheck", "--kernel-name", "kns=k", "--error-exitcode", "86",
                            "--print-limit", "100", sys.executable, str(target), "arg"]
    got = json.loads((tmp_path / "target.json").read_text())
    assert got["argv"] == ["arg"]
    assert got["env"]["PYTORCH_NO_CUDA_MEMORY_CACHING"] == "1" and got["env"]["KEEP_ME"] == "1"
    assert "PYTORCH_NO_CUDA_MEMORY_CACHING" not in os.environ
    assert run.returncode == 86 and (tmp_path / "raw" / "out.txt").read_text() == DEMO
    assert run.report.error_summary == 2 and run.report.records[0].kind == "write"


def test_find_sanitizer_order(tmp_path, monkeypatch):
    stub, _ = make_stub(tmp_path, "")
    assert find_sanitizer(stub) == stub
    with pytest.raises(ReplayError, match="not an executable"):
        find_sanitizer(tmp_path / "missing")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_sanitizer() == tmp_path / "compute-sanitizer"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(san_mod.os, "access", lambda p, m: False if str(p).startswith("/usr/local/cuda") else os.access(p, m))
    monkeypatch.setattr(san_mod, "_wheel_sanitizer", lambda: Path("/wheel/nvidia/cu13/compute-sanitizer/compute-sanitizer"))
    assert find_sanitizer() == Path("/wheel/nvidia/cu13/compute-sanitizer/compute-sanitizer")
    monkeypatch.setattr(san_mod, "_wheel_sanitizer", lambda: None)
    assert find_sanitizer() is None


@pytest.mark.parametrize("text, ran, limit, verdict, reason", [
    (CANNED_OOB, False, 100, Verdict.KERNEL_FAULT, None),
    (CANNED_CLEAN, True, 100, Verdict.NOT_REPRODUCED, None),
    (NO_GPU, False, 100, Verdict.INCONCLUSIVE, "target died before first instrumented call"),
    ("========= ERROR SUMMARY: 0 errors\n", False, 100, Verdict.INCONCLUSIVE, "kernel did not run"),
    ("========= ERROR SUMMARY: 500 errors\n", True, 0, Verdict.INCONCLUSIVE, "print limit hit"),
    ('========= Program hit cudaErrorLaunchFailure (error 719) due to "x" on CUDA API call to cudaMemcpy.\n'
     + "========= ERROR SUMMARY: 3 errors\n", True, 1, Verdict.INCONCLUSIVE, "print limit hit"),
    ("garbage\n", True, 100, Verdict.INCONCLUSIVE, "no error summary"),
])
def test_judge(text, ran, limit, verdict, reason):
    res = judge_sanitizer(parse_sanitizer_output(text), kernel_ran=ran, print_limit=limit)
    assert res.verdict is verdict and res.reason == reason


def test_judge_api_error_only_is_a_kernel_fault_without_access_record():
    text = ('========= Program hit cudaErrorIllegalAddress (error 700) due to "an illegal memory access was '
            'encountered" on CUDA API call to cudaDeviceSynchronize.\n========= ERROR SUMMARY: 1 error\n')
    res = judge_sanitizer(parse_sanitizer_output(text), kernel_ran=False, print_limit=100)
    assert res.verdict is Verdict.KERNEL_FAULT and res.first.number == 700 and "no access record" in res.summary


def _bundle(tmp_path, m=3):
    return build_bundle(make_awq(m, 64, 64, 32), {"group_size": 32, "call_index": 1}, tmp_path / "b.h5")


def test_planted_fixture_path_with_stub_names_the_buffer(tmp_path, monkeypatch):
    stub, record = make_stub(tmp_path, CANNED_OOB, rc=86)
    monkeypatch.setattr("qforensics.replay.kernel.build_kernel", lambda *a, **k: Path("/bin/true"))
    res, _y = run_project_kernel(_bundle(tmp_path), checked=False, work_dir=tmp_path / "w", sanitizer=str(stub),
                                 arch="sm_90", padding=4096)
    assert res.verdict is Verdict.KERNEL_FAULT
    assert res.line() == ("KERNEL FAULT | PLANTED-BUG FIXTURE (unchecked build): kernel qf_awq_gemm_unchecked, "
                          "block (0,0,0), thread (12,0,0), reads 16 bytes at 1 bytes past the end of `x` at awq_gemm.cu:94")
    argv = json.loads(record.read_text())["argv"]
    assert argv == ["--tool", "memcheck", "--kernel-name", "kns=qf_awq_gemm", "--error-exitcode", "86",
                    "--print-limit", "100", "--padding", "4096", "/bin/true", str(tmp_path / "w" / "kernel-in")]
    assert (tmp_path / "w" / "kernel-in" / "header.txt").is_file()
    assert (tmp_path / "w" / "sanitizer-memcheck.txt").read_text() == CANNED_OOB


def test_no_sanitizer_is_inconclusive(tmp_path, monkeypatch):
    monkeypatch.setattr("qforensics.replay.run.find_sanitizer", lambda explicit=None: None)
    res = sanitizer_leg(_bundle(tmp_path), kernel="torch-int4pack", launcher=None, work_dir=tmp_path / "w",
                        tool="memcheck", sanitizer=None, kernel_name=None, print_limit=100, timeout=60)
    assert res.verdict is Verdict.INCONCLUSIVE and res.reason == "no sanitizer"


def test_replay_without_gpu_never_claims_a_clean_sanitizer_run(tmp_path):
    out = replay(_bundle(tmp_path, m=8).path, kernel="torch-int4pack", gpu_probe=lambda: (False, "test"))
    verdicts = [(r.path, r.verdict) for r in out.results]
    assert verdicts == [("kernel", Verdict.NOT_REPRODUCED), ("sanitizer", Verdict.INCONCLUSIVE)]
    assert out.results[1].reason == "no GPU" and "not measured" in out.results[1].summary
    assert out.exit_code() == 0
    only = replay(_bundle(tmp_path, m=8).path, gpu_probe=lambda: (False, "test"))  # no kernel named: nothing measured
    assert [r.verdict for r in only.results] == [Verdict.INCONCLUSIVE, Verdict.INCONCLUSIVE]
    assert only.exit_code() == 1


LAUNCHER_MOD = '''
import json, numpy as np
def launch(tensors, meta):
    json.dump({"keys": sorted(tensors), "M": meta["M"], "x_dtype": str(tensors["x"].dtype)},
              open(meta_path(), "w"))
    return np.ones((meta["M"], meta["N"]), np.float32)
def meta_path():
    import os
    return os.environ["QF_TEST_LAUNCHER_OUT"]
'''


def test_launcher_runs_users_op_under_the_sanitizer(tmp_path, monkeypatch):
    (tmp_path / "mylaunch.py").write_text(LAUNCHER_MOD)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{Path(__file__).resolve().parents[2]}")
    monkeypatch.setenv("QF_TEST_LAUNCHER_OUT", str(tmp_path / "seen.json"))
    stub, record = make_stub(tmp_path, "========= ERROR SUMMARY: 0 errors\n", run_target=True)
    res = sanitizer_leg(_bundle(tmp_path), kernel=None, launcher="mylaunch:launch", work_dir=tmp_path / "w",
                        tool="memcheck", sanitizer=str(stub), kernel_name="kns=gemm", print_limit=100, timeout=120)
    argv = json.loads(record.read_text())["argv"]
    assert argv[:6] == ["--tool", "memcheck", "--kernel-name", "kns=gemm", "--error-exitcode", "86"]
    assert argv[8:12] == [sys.executable, "-m", "qforensics.replay.launcher", "--bundle"]
    assert json.loads((tmp_path / "seen.json").read_text()) == {"keys": ["qweight", "qzeros", "scales", "x"], "M": 3,
                                                                "x_dtype": "float16"}
    assert res.verdict is Verdict.NOT_REPRODUCED and res.path == "sanitizer"
    assert np.fromfile(tmp_path / "w" / "sanitizer-out" / "y.bin", "<f4").size == 3 * 64


def test_launcher_spec_errors():
    from qforensics.replay.launcher import load_launcher
    with pytest.raises(ReplayError, match="package.module:function"):
        load_launcher("nocolon")
    with pytest.raises(ReplayError, match="cannot import"):
        load_launcher("no_such_module_xyz:f")
    with pytest.raises(ReplayError, match="has no attribute"):
        load_launcher("json:nope")


REAL = os.environ.get("QFORENSICS_TEST_SANITIZER") or (str(find_sanitizer()) if find_sanitizer() else None)


def test_real_sanitizer_without_gpu_is_inconclusive(tmp_path):
    """Measured on a CPU-only machine: the tool reports it could not instrument anything.
    The test set-up installs the sanitizer wheel (extra `sanitizer`)."""
    assert REAL is not None, "compute-sanitizer not found: pip install 'qforensics[sanitizer]'"
    from qforensics.replay.run import detect_gpu
    if detect_gpu()[0]:
        pytest.skip("a GPU is present; tests/replay does not run GPU checks (see replay/gpu_check.py)")
    res, _y = run_project_kernel(_bundle(tmp_path), checked=True, work_dir=tmp_path / "w", sanitizer=REAL, arch="sm_90")
    assert res.verdict is Verdict.INCONCLUSIVE
    assert res.reason == "target died before first instrumented call"
