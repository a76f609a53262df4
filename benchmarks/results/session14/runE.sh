# Run E: warp kernels with batched weight staging + L2 prefetch of the first row; grid variants (WARP_ROWS, WARP_WPB)
# A/B against the pipelined kernels; timeline; then the whole GPU suite.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/ckc
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python -c "import time; t=time.time(); from cukernels import _loader; _loader.precompile(); print(f'precompile all {time.time()-t:.1f} s')"
timeout 90 python -m pytest -m gpu -q -p no:cacheprovider -n 8 -x tests/test_rms_norm.py tests/test_layer_norm.py 2>&1 | tail -4 | tee $OUT/runE_norm_tests.log
AB="rms_norm.WARP_ROWS=1,layer_norm.WARP_ROWS=1;rms_norm.WARP_ROWS=2,layer_norm.WARP_ROWS=2;rms_norm.WARP_ROWS=4,rms_norm.WARP_WPB=4,layer_norm.WARP_ROWS=4,layer_norm.WARP_WPB=4;rms_norm.BWD_KERNEL=pipe,layer_norm.BWD_KERNEL=pipe"
timeout 170 python benchmarks/bench_ops.py --no-startup --quick --only rms_norm,layer_norm --ab "$AB" 2>&1 | tee $OUT/runE_bench_ops.log | grep -A4 "bwd" | grep -v "^--"
timeout 40 python benchmarks/tune_norm_backward.py --timeline 2>&1 | tee $OUT/runE_timeline.log | tail -6
timeout 200 python -m pytest -m gpu -q -p no:cacheprovider -n 8 2>&1 | tee $OUT/runE_gpu_tests.log | grep -E "passed|failed|FAILED|ERROR" | tail -30
