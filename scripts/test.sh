#!/usr/bin/env bash
# The test command: set up, then run the whole suite (CPU; gpu-marked tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider "$@"
