set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/ckc
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python -c "import time; t=time.time(); from cukernels import _loader; print(_loader.precompile(['rms_norm','layer_norm'])); print(f'precompile {time.time()-t:.1f} s')"
timeout 200 python -m pytest -m gpu -q -p no:cacheprovider -n 8 -x tests/test_rms_norm.py tests/test_layer_norm.py 2>&1 | tail -25 | tee $OUT/runA_tests.log
timeout 150 python benchmarks/bench_ops.py --no-startup --quick --only rms_norm,layer_norm --ab "rms_norm.BWD_KERNEL=pipe,layer_norm.BWD_KERNEL=pipe" 2>&1 | tee $OUT/runA_bench_ops.log | grep -v "^ *$" | tail -40
timeout 120 python benchmarks/tune_norm_backward.py --quick 2>&1 | tee $OUT/runA_tune.log | tail -20
