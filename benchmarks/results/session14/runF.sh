# Run F (final code): ln_bwd_warp kept for bf16 C 520..1024 only (4-warp blocks, 4 rows a warp); rms_norm as before the
# session. The whole GPU suite first, then the layer_norm rows A/B, then (time permitting) the GPT-2 step A/B.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/ckc
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python -c "import time; t=time.time(); from cukernels import _loader; _loader.precompile(); print(f'precompile all {time.time()-t:.1f} s')"
timeout 60 python -m pytest -m gpu -q -p no:cacheprovider -x tests/test_layer_norm.py -k warp 2>&1 | tail -2 | tee $OUT/runF_first.log
timeout 200 python -m pytest -m gpu -q -p no:cacheprovider -n 8 2>&1 | tee $OUT/runF_gpu_tests.log | grep -E "passed|failed|FAILED|ERROR" | tail -30
timeout 40 python benchmarks/bench_ops.py --no-startup --quick --only layer_norm --ab "layer_norm.BWD_KERNEL=pipe" 2>&1 | tee $OUT/runF_bench_ops.log | grep -E -A1 "copy|bwd" | grep -v "^--"
el=$(( $(date +%s) - start )); echo "elapsed $el s"
[ $el -lt 300 ] && timeout 100 python benchmarks/bench_train.py --model gpt2 --steps 10 --ab "layer_norm.BWD_KERNEL=pipe" 2>&1 | tee $OUT/runF_bench_gpt2.log | grep -E "ms/step"
