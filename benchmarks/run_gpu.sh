#!/usr/bin/env bash
# One device call: start-up times (cold compile of every kernel family, then warm), the GPU test suite, the
# per-kernel benchmark. Usage on the GPU machine:  bash benchmarks/run_gpu.sh [bench_ops args...]
# Logs go to $OUT (the device tool's output folder) when set, else ./out.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}; mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cukernels-cupy-cache}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null
python -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)"
python benchmarks/bench_ops.py --startup-only --startup-cache "$CUPY_CACHE_DIR" 2>&1 | tee "$out/startup.log"
workers=$(python -c "import xdist" 2>/dev/null && echo "-n 4" || echo "")
timeout ${GPU_TEST_TIMEOUT:-400} python -m pytest -m gpu -q -p no:cacheprovider $workers 2>&1 | tee "$out/gpu_tests.log" | tail -n 60
timeout ${BENCH_TIMEOUT:-500} python benchmarks/bench_ops.py --no-startup --json "$out/bench_ops.json" "$@" 2>&1 | tee "$out/bench_ops.log"
