#!/usr/bin/env bash
# What running hicache needs, and nothing for its tests or the engines: torch (an installed
# one is reused; a CPU-only machine without one gets the pinned CPU build, never CUDA
# wheels), a C compiler and this Python's headers for the native modules, and the package
# with its core dependencies (pyproject.toml). The demo runs this; scripts/setup.sh runs it
# first and then installs what the tests need.
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

# The native paths (the index's loops, the frame loop, the disk writer, the page copy) are C
# that `pip install -e .` compiles into the tree (setup.py). Without a compiler the install
# still works and those paths run in Python (`hicache doctor` warns), so: best effort.
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    need=()
    command -v cc >/dev/null 2>&1 || need+=(gcc libc6-dev)
    "$PY" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
        || need+=(python3-dev)
    if [ ${#need[@]} -gt 0 ]; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null) \
            || echo "setup: could not install ${need[*]}; the native paths will run in Python" >&2
    fi
fi

"$PY" -m pip install -q -e .
