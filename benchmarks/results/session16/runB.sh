# Run B (session 16): where the gaps before the GEMMs went with the memsets as kernel nodes (B4xT64 timeline), and
# whether the shared-memory carveout switch between our kernels and cuBLAS' is the gap (_loader.CARVEOUT A/B).
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/ckc
start=$(date +%s)
timeout 90 python benchmarks/bench_train.py --configs b4t64 --steps 10 --timeline $OUT 2>&1 | tail -8 | tee $OUT/runB_timeline.log
C1="_loader.CARVEOUT=100"; C0="_loader.CARVEOUT=-1"
timeout 100 python benchmarks/bench_train.py --configs b4t64 --steps 30 --ab "$C1;$C0;$C1" 2>&1 | tee $OUT/runB_b4t64.log | grep -E "cukernels"
el=$(( $(date +%s) - start )); echo "elapsed $el s"
timeout 170 python benchmarks/bench_train.py --configs b8t1024 --steps 20 --ab "$C1;$C0;$C1" 2>&1 | tee $OUT/runB_b8t1024.log | grep -E "cukernels"
echo "elapsed $(( $(date +%s) - start )) s"
