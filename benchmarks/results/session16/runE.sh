# Run E (session 16): linear_cross_entropy stages an unaligned weight into padded rows (STAGE_WEIGHT): its GPU
# tests first, then the bench rows with the unstaged A/B row.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/ckc
start=$(date +%s)
timeout 200 python -m pytest -m gpu -q -p no:cacheprovider -n 8 tests/test_linear_cross_entropy.py 2>&1 | tail -3 | tee $OUT/runE_tests.log
grep -q "failed\|error" $OUT/runE_tests.log && { echo "TESTS FAILED"; exit 1; }
el=$(( $(date +%s) - start )); echo "elapsed $el s"
timeout 150 python benchmarks/bench_ops.py --no-startup --quick --only linear_cross_entropy --ab "linear_cross_entropy.STAGE_WEIGHT=0" 2>&1 | tee $OUT/runE_bench_lce.log | grep -E -A1 "^linear"
echo "elapsed $(( $(date +%s) - start )) s"
