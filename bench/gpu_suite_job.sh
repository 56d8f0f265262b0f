#!/usr/bin/env bash
# The GPU test suite in one device call: `pytest -m gpu tests` with flashinfer's JIT cache carried.
# Usage, from the root of a copy of this tree on the GPU machine (the device tool's carry), with
# $OUT set, the wheels of ../shared/gpu/wheels.sh in ../.whl, extra wheels (pytest and its
# dependencies) in .data/whl, and a tarball of a kept $FLASHINFER_WORKSPACE_BASE/.cache in
# .data/fi/fi.tar.xz.* (split in parts when large):
#   bash bench/gpu_suite_job.sh [PYTEST_SECONDS]
# flashinfer's builds are ninja targets: pip gives the installed sources fresh file times, newer
# than the cached builds, and ninja would rebuild every module (minutes each), so the installed
# files are dated before the cache. The cache, with what this run compiled, is written back to
# $OUT/fi.tar.xz for the next call.
set -u
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  ../.whl/*.whl .data/whl/*.whl 2>/dev/null
find /tmp/site -exec touch -h -d '2020-01-01 00:00' {} + 2>/dev/null
mkdir -p /tmp/pk/new && ln -sfn "$PWD" /tmp/pk/new/espalier  # `import espalier` is this root
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws PYTHONUNBUFFERED=1
mkdir -p /tmp/fiws && cat .data/fi/fi.tar.xz.* | tar -xJ -C /tmp/fiws && echo "jit cache restored"
(python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1); echo "build rc $?"
[ -e v1 ] || ln -s proto/espalier/v1 v1  # the generated code's own imports
PYTHONPATH=/tmp/site:/tmp/pk/new:$PWD/clients/python:$PWD timeout "${1:-480}" \
  python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -o faulthandler_timeout=200 \
  --durations=8 tests/engine tests/kernels > "$OUT/pytest_gpu.log" 2>&1  # where the gpu tests are
echo "pytest rc $? at $(( $(date +%s) - t0 )) s"
grep -E "passed|failed|FAILED|ERROR" "$OUT/pytest_gpu.log" | tail -n 20 | cut -c1-300
(cd /tmp/fiws && tar -cJf "$OUT/fi.tar.xz" .cache)
