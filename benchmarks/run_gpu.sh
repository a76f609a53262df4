#!/usr/bin/env bash
# One device call: the GPU test suite, then the per-kernel benchmark (and the training benchmark when asked).
# Usage on the GPU machine:  bash benchmarks/run_gpu.sh [bench_ops args...]
# Logs go to $OUT (the device tool's output folder) when set, else ./out.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}; mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cukernels-cupy-cache}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null
python -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)"
python benchmarks/bench_ops.py --json "$out/bench_ops.json" "$@" 2>&1 | tee "$out/bench_ops.log"
python -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -n 40
