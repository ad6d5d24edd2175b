#!/usr/bin/env bash
# The main job on the real model: capture each SmolLM2 quantization scenario in HF transformers
# and in the real vLLM engine, analyze each trace, write its HTML incident report, and replay the
# vLLM AWQ failure through vLLM's own CPU kernel, all into ${1:-qforensics-demo}/.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-qforensics-demo}
bash scripts/install.sh
qforensics demo -o "$OUT"
VPY=$(bash scripts/install-vllm.sh | tail -n 1)
VBIN=$(dirname "$VPY")
# vLLM's W4A16 path (not the W4A8 one it takes on AMX CPUs), so that replay can read the layer
rm -f "$OUT/vllm/vllm-awq-inf-scale.h5"  # not left over from an earlier run
VLLM_CPU_INT4_W4A8=0 "$VBIN/qforensics" demo --engine vllm -o "$OUT/vllm"
rm -rf "$OUT/vllm/replay-repro"  # --export writes into a new or empty folder
if [ -f "$OUT/vllm/vllm-awq-inf-scale.h5" ]; then
    set +e  # replay exits 1 on its finding (DATA here)
    VLLM_CPU_INT4_W4A8=0 "$VBIN/qforensics" replay "$OUT/vllm/vllm-awq-inf-scale.h5" \
        --json "$OUT/vllm/replay.json" --export "$OUT/vllm/replay-repro"
    rc=$?
    set -e
    [ "$rc" -le 1 ] || exit "$rc"
else  # the demo said why above: this CPU's vLLM build has no W4A16 kernel
    echo "replay of the vLLM AWQ failure not run: vLLM could not serve the AWQ scenario here"
fi
echo "demo written to $OUT/"
