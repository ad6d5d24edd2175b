#!/usr/bin/env bash
# The main job on the real model: capture each SmolLM2 quantization scenario, analyze it and
# write its HTML incident report into ${1:-qforensics-demo}/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
qforensics demo -o "${1:-qforensics-demo}"
