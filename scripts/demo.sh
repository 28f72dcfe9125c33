#!/usr/bin/env bash
# The main job: start `hicache serve` with embedded defaults and run a demo workload through it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec hicache demo "$@"
