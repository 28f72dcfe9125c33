#!/usr/bin/env bash
# The main job: start `hicache serve` with embedded defaults and run a demo workload through it.
# Installs only what that needs (scripts/setup_core.sh); scripts/test.sh installs the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_core.sh
exec hicache demo "$@"
