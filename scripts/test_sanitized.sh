#!/usr/bin/env bash
# The C checked like C: the native modules built once more with AddressSanitizer and UBSan
# (setup.py with HICACHE_SANITIZE, in a copy of the tree: the checkout's own build stays),
# and the tests of the C paths run against that build: the C frame fuzzer, the wire fuzzer
# on the native frame loop, the fast path, the native frame loop, the native index (its packed
# keys, sketch and restore check), the disk writer, the start-up scan and the copy. Python
# runs with the ASan runtime preloaded, leak detection off (CPython's own allocations would
# drown it; the C fuzzer checks its leaks itself). Every sanitizer report, from any process
# (daemons included), goes to a file: one file fails the run. tests/conftest.py fails every
# test when the modules loaded are not the sanitized build.
# Needs gcc's libasan and libubsan (Debian: gcc brings them). CI runs it (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CC=${CC:-gcc}
SANITIZE=address,undefined
start=$SECONDS
work=$(mktemp -d "${TMPDIR:-/tmp}/hicache-sanitized.XXXXXX")
trap 'rm -rf "$work"' EXIT
tar --exclude=./.git --exclude=./build --exclude='*.so' --exclude=__pycache__ -cf - . | tar -C "$work" -xf -
cd "$work"
if ! HICACHE_SANITIZE=$SANITIZE HICACHE_NATIVE_STRICT=1 CC=$CC "$PY" setup.py -q build_ext --inplace \
        >build.log 2>&1; then
    cat build.log
    echo "test_sanitized: the sanitized build failed" >&2
    exit 1
fi
built=$SECONDS
mkdir reports
status=0
LD_PRELOAD=$("$CC" -print-file-name=libasan.so) \
ASAN_OPTIONS="detect_leaks=0:log_path=$work/reports/asan" \
UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$work/reports/ubsan" \
HICACHE_SANITIZE=$SANITIZE CI=true \
    "$PY" -m pytest -q -p no:cacheprovider -k "not asyncio" \
    tests/native tests/robustness/test_wire_fuzz.py tests/daemon/test_fast_path.py tests/daemon/test_native_paths.py \
    tests/rpc/test_fast_encoding.py tests/rpc/test_native_conn.py tests/index/test_native_index.py \
    tests/tiers/test_disk_native.py tests/tiers/test_disk_scan.py tests/index/test_restore_packed.py \
    tests/index/test_key_run.py tests/index/test_admission.py tests/kernels/test_native_copy.py "$@" || status=$?
if compgen -G "reports/*" >/dev/null; then
    cat reports/*
    echo "test_sanitized: sanitizer findings above" >&2
    status=1
fi
echo "test_sanitized: build $((built - start)) s, tests $((SECONDS - built)) s, status $status"
exit $status
