"""Prepared GPU check (run on a machine with a GPU; not run where none is lent).

    python -m qforensics.replay.gpu_check OUT_DIR [--sanitizer PATH] [--arch sm_90]

Builds the project kernel (checked and unchecked), replays an in-bounds bundle (M=8: expect
NOT REPRODUCED, 0 errors, output close to the float64 reference) and an out-of-bounds one (M=3,
fewer rows than the 8-row tile: expect CONFIRMED, a 16-byte read past the end of `x`), and a
g_idx-out-of-range one (expect CONFIRMED on `qzeros`/`scales`). Raw sanitizer output and a
summary.json land in OUT_DIR. Exit 0 when every expectation held, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from qforensics.replay import awq
from qforensics.replay.bundle import build_bundle
from qforensics.replay.kernel import build_kernel, detect_arch
from qforensics.replay.run import replay
from qforensics.replay.verdict import Verdict


def make_snapshot(m: int, n: int = 128, k: int = 256, group_size: int = 64, bad_g_idx: bool = False,
                  seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    groups = k // group_size
    snap = {
        "input.0": rng.standard_normal((m, k)).astype(np.float16),
        "qweight": awq.pack_int4(rng.integers(0, 16, (k, n))),
        "qzeros": awq.pack_int4(rng.integers(0, 16, (groups, n))),
        "scales": (rng.random((groups, n)) * 0.01 + 0.001).astype(np.float16),
    }
    if bad_g_idx:
        g = np.arange(k, dtype=np.int32) // group_size
        g[k // 2] = groups + 3  # out of range: reads qzeros/scales past their end
        snap["g_idx"] = g
    return snap


CASES = {
    "in_bounds_m8": (dict(m=8), Verdict.NOT_REPRODUCED),
    "m3_fewer_rows_than_tile": (dict(m=3), Verdict.CONFIRMED),
    "g_idx_out_of_range": (dict(m=8, bad_g_idx=True), Verdict.CONFIRMED),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qforensics.replay.gpu_check")
    p.add_argument("out_dir")
    p.add_argument("--sanitizer", default=None)
    p.add_argument("--arch", default=None)
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    arch = args.arch or detect_arch() or "sm_90"
    summary: dict[str, object] = {"arch": arch, "cases": {}}
    t0 = time.time()
    for checked in (True, False):
        build_kernel(arch, checked=checked)
    summary["build_s"] = round(time.time() - t0, 2)
    ok = True
    for name, (kw, expect) in CASES.items():
        case_dir = out / name
        bundle_path = case_dir / "bundle.h5"
        case_dir.mkdir(parents=True, exist_ok=True)
        g = 64
        build_bundle(make_snapshot(**kw), {"group_size": g}, bundle_path)
        t1 = time.time()
        outcome = replay(bundle_path, mode="gpu", sanitizer=args.sanitizer, arch=arch, work_dir=case_dir)
        gpu = outcome.results[0]
        passed = gpu.verdict is expect
        ok &= passed
        summary["cases"][name] = {"expected": expect.value, "got": gpu.verdict.value, "line": gpu.line(),
                                  "passed": passed, "seconds": round(time.time() - t1, 2),
                                  "details": gpu.to_dict()["details"]}
        sys.stdout.write(f"{'PASS' if passed else 'FAIL'} {name}: {gpu.line()}\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
