"""gpu_check's cases each run in a work folder of its own (CPU: the sanitizer is a stub that
records the bundle its target would open, and whether that file exists when it runs)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from replay_helpers import make_awq

from qforensics.replay.build import build_bundle
from qforensics.replay.gpu_check import run_case, torch_case
from qforensics.replay.verdict import Verdict

STUB = """#!/bin/sh
b=""; prev=""
for a in "$@"; do [ "$prev" = "--bundle" ] && b="$a"; prev="$a"; done
echo "========= COMPUTE-SANITIZER"
if [ -f "$b" ]; then echo "stub: bundle present $b"; echo "qforensics-launcher: done"; \
echo "========= ERROR SUMMARY: 0 errors"; else echo "qforensics-launcher: error: $b: no such file"; \
echo "========= Error: Target application terminated before first instrumented API call"; exit 255; fi
"""


def test_each_case_owns_its_bundle_and_cleanup_spares_the_others(tmp_path):
    stub = tmp_path / "compute-sanitizer"
    stub.write_text(STUB)
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    shared = build_bundle(make_awq(8, 64, 128, 64), {"group_size": 64, "layout": "awq-gemm"})
    out, work_root, summary = tmp_path / "out", tmp_path / "work", {"cases": {}}
    out.mkdir()
    # as in gpu_check.main: the int4pack and torch.compile cases share one in-memory bundle
    for name, kernel in (("torch_int4pack_mm", "torch-int4pack"), ("torch_compile_triton", "torch-compile")):
        run_case(name, {Verdict.NOT_REPRODUCED}, torch_case(shared, kernel, sanitizer=str(stub), timeout=120,
                                                            device="cpu"), out=out, work_root=work_root,
                 summary=summary)
    assert shared.path is None  # the shared bundle was never written; each case wrote its own copy
    for name in ("torch_int4pack_mm", "torch_compile_triton"):
        entry = summary["cases"][name]
        assert entry["passed"], json.dumps(entry)[:2000]
        numeric, san = entry["results"]
        assert numeric["bound_model"] is not None and san["verdict"] == "NOT REPRODUCED"
        argv = san["details"]["sanitizer"]["argv"]
        bundle = Path(argv[argv.index("--bundle") + 1])
        assert bundle.parent == work_root / name  # its own folder, not another case's
        raw = (out / f"{name}.sanitizer-memcheck.txt").read_text()
        assert f"stub: bundle present {bundle}" in raw
        assert not (work_root / name).exists()  # removed after its own case, and only then
    assert os.listdir(work_root) == []


def test_a_failing_case_is_recorded_and_its_folder_removed(tmp_path):
    summary = {"cases": {}}

    def boom(work: Path):
        (work / "x").write_text("1")
        raise RuntimeError("no CUDA")

    assert run_case("broken", {Verdict.NOT_REPRODUCED}, boom, out=tmp_path, work_root=tmp_path / "w",
                    summary=summary) is False
    assert "no CUDA" in summary["cases"]["broken"]["error"] and not (tmp_path / "w" / "broken").exists()
