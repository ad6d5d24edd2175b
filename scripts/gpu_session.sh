#!/usr/bin/env bash
# Everything a session lent a GPU should run there, in ONE device call (a call may run 10
# minutes; the whole task has 15 minutes of device time):
#
#   bash scripts/gpu_session.sh                  # on the GPU machine, from the checkout
#   bash scripts/gpu_session.sh --self-check     # here, on the CPU: the same plumbing, a
#                                                # 2-layer random model (its figures are no
#                                                # GPU figures)
#
# Runs, each with a time limit of its own (550 s in all, under the tool's 600 s a call), so
# that one that hangs leaves the rest:
#   1. scripts/gpu_check.py: issue 39's GPU targets (SmolLM2's architecture, bf16,
#      reduce-overhead, 32 tokens) and the planted-NaN case; its JSON lines;
#   2. pytest on tests/hooks/test_gpu.py: the op's Triton kernel compiled for the device,
#      compiled capture under CUDA graphs and eager capture on the device, each against the
#      CPU. The GPU machine has no pytest and no network: the checkout carries the wheels in
#      ./wheels (pytest, pluggy, iniconfig, pygments, all pure Python); without them this part
#      is skipped and says so;
#   3. bench/capture_overhead.py --random --device cuda: HF eager on the GPU (plain, a bare
#      hook, capture's default path, capture on the stats op), the figures that decide whether
#      eager capture moves onto the op there (issue 39's one hot path);
#   4. bench/gpu_step_host.py --device cuda: the host time of a compiled step's begin and end,
#      function by function (issue 39's 0.1 ms);
#   5. bench/compiled_guards.py --device cuda: the host time of the compiled model's guards.
# Writes everything under $OUT (the device tool's output folder; ./gpu-session otherwise) and
# tars it into $OUT/gpu-session.tgz (the tool brings back few files). Exit status: that of
# gpu_check.py (0: every target held; 1: one did not; 2: no GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
SELF=0
[[ ${1:-} == --self-check ]] && SELF=1
OUT=${OUT:-gpu-session}
RES=$OUT/gpu-session
mkdir -p "$RES"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
if compgen -G "wheels/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --target /tmp/qf-site wheels/*.whl \
        >"$RES/wheels.log" 2>&1 && export PYTHONPATH=$PYTHONPATH:/tmp/qf-site
fi
{ nvidia-smi 2>&1 || echo "no nvidia-smi"; $PY -c "import torch, triton, transformers
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers',
      transformers.__version__)" 2>&1; } >"$RES/machine.txt"
step() {  # step NAME SECONDS CMD...: run with a limit, its output to NAME.log, a line here
    local name=$1 limit=$2 t0=$SECONDS rc=0
    shift 2
    timeout "$limit" "$@" >"$RES/$name.log" 2>&1 || rc=$?
    echo "gpu-session: $name rc=$rc in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$RES/steps.txt"
    return $rc
}
if ((SELF)); then
    CHECK=(--allow-cpu --random --layers 2 --tokens 4)
    GUARDS=(--device cpu --random --layers 2 --rounds 1 --calls 5)
    EAGER=(--device cpu --layers 2 --tokens 4 --rounds 1)
    STEP_HOST=(--device cpu --layers 2 --steps 40)
    export QF_GPU_TEST_DEVICE=cpu  # test_gpu.py's tests on the CPU: checks the tests only
else
    CHECK=(--timeout 140)  # each of its two phases: compile (57 s plain on an H200) and steps
    GUARDS=(--device cuda --dtype bfloat16)
    EAGER=(--device cuda --dtype bfloat16 --tokens 32 --rounds 2)  # 16 generates in all
    STEP_HOST=(--device cuda)
fi
rc=0
step gpu_check 300 $PY scripts/gpu_check.py --out "$RES/gpu-check" "${CHECK[@]}" || rc=$?
if $PY -c "import pytest" 2>/dev/null; then
    step pytest 100 $PY -m pytest -q -p no:cacheprovider -rfEs --durations=10 \
        tests/hooks/test_gpu.py
else
    echo "gpu-session: pytest skipped (no pytest: see wheels/ above)" | tee -a "$RES/steps.txt"
fi
step eager 60 $PY bench/capture_overhead.py --random --no-nnsight "${EAGER[@]}"
step step_host 45 $PY bench/gpu_step_host.py "${STEP_HOST[@]}"
step compiled_guards 45 $PY bench/compiled_guards.py "${GUARDS[@]}"
tail -n 12 "$RES/gpu_check.log"
tar czf "$OUT/gpu-session.tgz" -C "$OUT" gpu-session
echo "gpu-session: results in $OUT/gpu-session.tgz"
exit $rc
