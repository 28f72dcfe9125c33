#!/usr/bin/env bash
# What running hicache needs, and nothing for its tests or the engines: torch (an installed
# one is reused; a CPU-only machine without one gets the pinned CPU build, never CUDA
# wheels) and the package with its core dependencies (pyproject.toml). The demo runs this;
# scripts/setup.sh runs it first and then installs what the tests need.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        echo "setup: no torch found; install the torch build that matches your CUDA first" >&2
        exit 1
    fi
    # CPU-only machine: the pinned CPU build (a local wheel where the machine provides one).
    "$PY" -m pip install -q "torch==2.13.0"
fi

"$PY" -m pip install -q -e .
