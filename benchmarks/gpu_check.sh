#!/usr/bin/env bash
# On the GPU machine (docs/gpu.md): install the wheels `make gpu-check` put in .gpu-wheels beside the image's torch
# (never replacing it), run benchmarks/gpu_check.py (at most 8 minutes) and the tests marked `cuda`; every file
# lands in $OUT. Usage: bash benchmarks/gpu_check.sh <commit measured> (the copy there has no git history).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dtrain-site \
    .gpu-wheels/*.whl || { echo "gpu_check.sh: the carried wheels did not install (carry .gpu-wheels)"; exit 2; }
export PYTHONPATH="$PWD:/tmp/dtrain-site" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv >"$OUT/nvidia-smi.csv" 2>&1
timeout 480 python3 benchmarks/gpu_check.py --device cuda --out "$OUT" --commit "${1:-unknown}" 2>&1 \
    | tee "$OUT/gpu_check.log"
check=${PIPESTATUS[0]}
timeout 100 python3 -m pytest -m cuda tests/unit/test_cuda.py -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest_cuda.log"
tests=${PIPESTATUS[0]}
echo "gpu_check.sh: gpu_check.py exit $check, cuda tests exit $tests"
exit $(( check != 0 || tests != 0 ))
