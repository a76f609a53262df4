# Run C: weight row staged in shared memory; norm tests (fail fast), norm A/B, row sweep + timeline; LLaMA step.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/ckc
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python -c "import time; t=time.time(); from cukernels import _loader; _loader.precompile(); print(f'precompile all {time.time()-t:.1f} s')"
timeout 100 python -m pytest -m gpu -q -p no:cacheprovider -n 8 -x tests/test_rms_norm.py tests/test_layer_norm.py 2>&1 | tail -4 | tee $OUT/runC_norm_tests.log
timeout 100 python benchmarks/bench_ops.py --no-startup --quick --only rms_norm,layer_norm --ab "rms_norm.BWD_KERNEL=pipe,layer_norm.BWD_KERNEL=pipe" 2>&1 | tee $OUT/runC_bench_ops.log | grep -A1 "bwd" | grep -v "^--"
timeout 80 python benchmarks/tune_norm_backward.py --quick 2>&1 | tee $OUT/runC_tune.log | tail -14
timeout 40 python benchmarks/tune_norm_backward.py --timeline 2>&1 | tee $OUT/runC_timeline.log | tail -6
timeout 200 python benchmarks/bench_train.py --configs b8t1024,b4t64 --ab "rms_norm.BWD_KERNEL=pipe" 2>&1 | tee $OUT/runC_bench_train.log | grep -E "cukernels|peak"
