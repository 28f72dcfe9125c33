#!/usr/bin/env bash
# The checks that need a GPU: the vLLM connector's CUDA copy path, every other `gpu`-marked
# test, then the GPU transfer bench.
# Meant for a machine with CUDA, torch and Triton already installed (no network):
# packages hicache needs beyond those come as wheels in ./.whl (see README, "GPU checks").
# Writes the logs and the bench JSON under ${OUT:-./gpu-out}.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-./gpu-out}"
mkdir -p "$out"
py="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/hicache-site .whl/*.whl \
        || exit 1
    export PYTHONPATH="/tmp/hicache-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$py" - <<'PY' 2>&1 | tee "$out/env.txt"
import torch, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA")
PY
# The vLLM connector's copy path on CUDA (needs no vLLM): vLLM-shaped block tensors through the
# registered arena bit for bit, and its load/save streams ordered with real events.
"$py" -m pytest -q -p no:cacheprovider -m gpu -rs tests/integrations/test_vllm_cuda.py 2>&1 \
    | tee "$out/vllm-cuda.txt"
vllm_rc=${PIPESTATUS[0]}
"$py" -m pytest -q -p no:cacheprovider -m gpu -rs --continue-on-collection-errors --ignore=tests/integrations/test_vllm_cuda.py "${@:-tests}" 2>&1 \
    | tee "$out/gpu-tests.txt"
tests_rc=${PIPESTATUS[0]}
[ "$vllm_rc" = 0 ] || tests_rc=$vllm_rc
"$py" -m hicache.cli bench transfer --device cuda --json ${BENCH_ARGS:-} > "$out/bench-transfer-cuda.json" \
    2> "$out/bench-stderr.txt"
bench_rc=$?
# The vLLM connector's block copies on CUDA (its Triton kernel, and the torch path it replaced).
"$py" -m hicache.cli bench blockcopy --device cuda --repeats 5 --json > "$out/bench-blockcopy-cuda.json" \
    2>> "$out/bench-stderr.txt" || bench_rc=1
[ "$bench_rc" = 0 ] && "$py" -c "import json,sys; from hicache.bench.report import print_rows; d=json.load(open(sys.argv[1])); \
print_rows('transfer', d['results'], False)" "$out/bench-transfer-cuda.json" 2>&1 | tee "$out/bench-transfer-cuda.txt"
[ "$bench_rc" = 0 ] && "$py" -c "import json,sys; from hicache.bench.report import print_rows; d=json.load(open(sys.argv[1])); \
print_rows('blockcopy', d['results'], False)" "$out/bench-blockcopy-cuda.json" 2>&1 | tee "$out/bench-blockcopy-cuda.txt"
[ "$bench_rc" = 0 ] || cat "$out/bench-stderr.txt"
echo "vllm cuda rc=$vllm_rc, gpu tests rc=$tests_rc, bench rc=$bench_rc"
exit $(( tests_rc || bench_rc ))
