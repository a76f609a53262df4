# Run G (session 15, final code): the layer_norm race fix first (fail fast), the whole GPU suite, then the
# layer_norm backward rows (warp vs pipe A/B) and, time permitting, the GPT-2 step.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/ckc
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,power.limit,temperature.gpu --format=csv,noheader
python -c "import time; t=time.time(); from cukernels import _loader; _loader.precompile(); print(f'precompile all {time.time()-t:.1f} s')"
timeout 90 python -m pytest -m gpu -q -p no:cacheprovider -x tests/test_layer_norm.py -k "warp" 2>&1 | tail -2 | tee $OUT/runG_first.log
grep -q "failed" $OUT/runG_first.log && { echo "FIRST TEST FAILED"; exit 1; }
timeout 260 python -m pytest -m gpu -q -p no:cacheprovider -n 8 2>&1 | tee $OUT/runG_gpu_tests.log | grep -E "passed|failed|FAILED|ERROR" | tail -30
el=$(( $(date +%s) - start )); echo "elapsed $el s"
[ $el -lt 400 ] && timeout 40 python benchmarks/bench_ops.py --no-startup --quick --only layer_norm --ab "layer_norm.BWD_KERNEL=pipe" 2>&1 | tee $OUT/runG_bench_ops.log | grep -E -A1 "bwd" | grep -v "^--"
el=$(( $(date +%s) - start )); echo "elapsed $el s"
[ $el -lt 440 ] && timeout 60 python benchmarks/bench_train.py --model gpt2 --steps 10 2>&1 | tee $OUT/runG_bench_gpt2.log | grep -E "cukernels"
