# Run B (session 15): CE cache hints (correctness first), then cross_entropy / linear_cross_entropy A/B in
# bench_ops, then the LLaMA-1B B8xT1024 step (head in 2 chunks now) with CACHE_HINTS and GRAD_BF16 A/B rows,
# with nvidia-smi sampling clocks and power during the step benchmark.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/ckc
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv,noheader
timeout 120 python -m pytest -m gpu -q -p no:cacheprovider -x tests/test_cross_entropy.py -k "cache_hints or llama_vocab or matches_reference" 2>&1 | tail -2 | tee $OUT/runB_first.log
timeout 150 python -m pytest -m gpu -q -p no:cacheprovider -n 4 tests/test_cross_entropy.py tests/test_linear_cross_entropy.py tests/test_models.py 2>&1 | tail -2 | tee $OUT/runB_tests.log
timeout 150 python benchmarks/bench_ops.py --no-startup --only cross_entropy,linear_cross_entropy --ab "cross_entropy.CACHE_HINTS=0" 2>&1 | tee $OUT/runB_bench_ops.log | grep -E "fused|fwd\+bwd" | head -30
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv,noheader -lms 100 > $OUT/runB_smi.csv &
SMI=$!
timeout 280 python benchmarks/bench_train.py --configs b8t1024 --ab "cross_entropy.CACHE_HINTS=0;__main__.GRAD_BF16=1" 2>&1 | tee $OUT/runB_bench_train.log | grep -E "cukernels|peak"
kill $SMI
