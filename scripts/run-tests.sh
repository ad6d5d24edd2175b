#!/usr/bin/env bash
# Everything the tests need on a fresh machine, then the whole suite. Browser tests drive
# Debian's headless Chromium; nothing is skipped for want of it.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver
fi
bash scripts/install.sh
PY=${PYTHON:-python3}
$PY -m pytest -q -p no:cacheprovider "$@"
