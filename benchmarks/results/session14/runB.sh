# Run B: rows interleaved over blocks (r % grid); norm tests (fail fast), norm A/B, timeline; then the whole GPU suite.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/ckc
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python -c "import time; t=time.time(); from cukernels import _loader; print(_loader.precompile(['rms_norm','layer_norm'])); print(f'precompile {time.time()-t:.1f} s')"
timeout 100 python -m pytest -m gpu -q -p no:cacheprovider -n 8 -x tests/test_rms_norm.py tests/test_layer_norm.py 2>&1 | tail -4 | tee $OUT/runB_norm_tests.log
timeout 100 python benchmarks/bench_ops.py --no-startup --quick --only rms_norm,layer_norm --ab "rms_norm.BWD_KERNEL=pipe,layer_norm.BWD_KERNEL=pipe" 2>&1 | tee $OUT/runB_bench_ops.log | grep -A1 "bwd" | grep -v "^--"
timeout 60 python benchmarks/tune_norm_backward.py --quick --timeline 2>&1 | tee $OUT/runB_timeline.log | tail -6
python -c "import time; t=time.time(); from cukernels import _loader; _loader.precompile(); print(f'precompile all {time.time()-t:.1f} s')"
timeout 240 python -m pytest -m gpu -q -p no:cacheprovider -n 8 2>&1 | tee $OUT/runB_gpu_tests.log | grep -E "passed|failed|FAILED|ERROR" | tail -30
