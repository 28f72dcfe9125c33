#!/usr/bin/env bash
# SGLang for hicache's SGLang storage backend (hicache.integrations.sglang) and its tests,
# next to the torch that is already installed (the CPU build here). Idempotent; when
# everything is in place it checks package metadata and exits in well under a second.
#
# Why not `pip install sglang==0.5.23`: its wheel pins torch==2.14.1 and CUDA packages
# (flashinfer, deep-gemm, cutlass DSL, ...), which would replace the CPU torch with a
# multi-GB CUDA build. The backend needs only what imports SGLang's storage API, its
# backend factory, its key hash and its host KV pools. So: sglang itself without its
# dependencies, then only the packages those imports use, each installed only when it
# is missing (a version another engine installed, e.g. vLLM's, is kept), with torch held
# at the installed version. Pins that differ from sglang's own (compressed-tensors 0.17,
# not 0.18) are the vLLM-compatible ones; the imports work with them.
#
# Also: g++ and the OpenSSL headers (apt) for SGLang's page-key hash, a C++ extension it
# builds on first use, which is built here once. torchvision: see
# hicache/integrations/sglang_cpu.py (the index's build needs CUDA; tests use a placeholder).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SGLANG_VERSION=0.5.23

# module:pip-spec, for what `import sglang.srt.mem_cache.memory_pool_host`, the storage
# modules and the server pull in on a machine that has torch and hicache's own dependencies
REQUIREMENTS=(
    orjson:orjson psutil:psutil pybase64:pybase64 requests:requests PIL:pillow fastapi:fastapi
    msgspec:msgspec pydantic:pydantic zmq:pyzmq tqdm:tqdm IPython:IPython aiohttp:aiohttp dill:dill
    sentencepiece:sentencepiece tvm_ffi:apache-tvm-ffi gguf:gguf packaging:packaging
    transformers:transformers==5.19.0 compressed_tensors:compressed-tensors==0.17.0 triton:triton==3.9.0
    # what `python -m sglang.launch_server` imports besides (tests/integrations/test_sglang_server.py)
    soundfile:soundfile uvicorn:uvicorn uvloop:uvloop openai:openai setproctitle:setproctitle
    partial_json_parser:partial-json-parser xgrammar:xgrammar einops:einops scipy:scipy
    python_multipart:python-multipart tiktoken:tiktoken
)

ready() {
    "$PY" - "$SGLANG_VERSION" "${REQUIREMENTS[@]}" <<'EOF'
import importlib.util, importlib.metadata as md, sys, glob, os
if md.version("sglang") != sys.argv[1]:
    sys.exit(1)
for item in sys.argv[2:]:
    if importlib.util.find_spec(item.split(":")[0]) is None:
        sys.exit(1)
ext = os.path.join(os.environ.get("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/torch_extensions")),
                   "py*_cpu", "hicache_hash_cpp", "*.so")
sys.exit(0 if glob.glob(ext) else 1)
EOF
}

if ready 2>/dev/null; then
    exit 0
fi

# the C++ toolchain and OpenSSL headers for the hash extension (best effort, as in setup.sh)
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    need=()
    command -v g++ >/dev/null 2>&1 || need+=(g++)
    dpkg -s libssl-dev >/dev/null 2>&1 || need+=(libssl-dev)
    if [ ${#need[@]} -gt 0 ]; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null) \
            || echo "setup_sglang: could not install ${need[*]}; SGLang's key hash will not build" >&2
    fi
fi

torch_version=$("$PY" -c "import torch; print(torch.__version__)")
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$torch_version" >"$constraints"

missing=()
for item in "${REQUIREMENTS[@]}"; do
    "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('${item%%:*}') is None)" \
        || missing+=("${item#*:}")
done
"$PY" -c "import ninja" 2>/dev/null || command -v ninja >/dev/null 2>&1 || missing+=(ninja)
if [ ${#missing[@]} -gt 0 ]; then
    "$PY" -m pip install -q -c "$constraints" "${missing[@]}"
fi
"$PY" -m pip install -q --no-deps "sglang==$SGLANG_VERSION"

# import everything the backend and its tests use, and build the hash extension once
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" - <<'EOF'
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: F401
from sglang.srt.mem_cache.utils import get_hash_str
from hicache.integrations.sglang import HiCacheStore  # noqa: F401
from hicache.integrations.sglang_cpu import import_host_pools
import_host_pools()
get_hash_str([1, 2, 3, 4], None, page_size=4)
print("setup_sglang: sglang ready")
EOF
