# Run C (session 15, final code): every kernel compiled, a fail-fast first test, then the whole GPU suite.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/ckc
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader
python -c "import time; t=time.time(); from cukernels import _loader; _loader.precompile(); print(f'precompile all {time.time()-t:.1f} s')"
timeout 60 python -m pytest -m gpu -q -p no:cacheprovider -x tests/test_cross_entropy.py -k cache_hints 2>&1 | tail -2 | tee $OUT/runC_first.log
timeout 330 python -m pytest -m gpu -q -p no:cacheprovider -n 8 2>&1 | tee $OUT/runC_gpu_tests.log | grep -E "passed|failed|FAILED|ERROR" | tail -30
