# Run A (session 15): where the LLaMA-1B B8xT1024 step goes now (per-kernel profile, graph-replayed), and the
# fused head's chunk count and gradient dtype A/B in the whole step (same process).
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/ckc
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv,noheader
timeout 90 python -m pytest -m gpu -q -p no:cacheprovider -x tests/test_linear_cross_entropy.py 2>&1 | tail -2 | tee $OUT/runA_first.log
timeout 200 python benchmarks/profile_step.py --graph --configs b8t1024 --top 70 2>&1 | tee $OUT/runA_profile.log | tail -75
AB="linear_cross_entropy.WORKSPACE_BUDGET=1073741824;linear_cross_entropy.WORKSPACE_BUDGET=2200000000;__main__.GRAD_BF16=1;__main__.GRAD_BF16=1,linear_cross_entropy.WORKSPACE_BUDGET=2200000000"
timeout 280 python benchmarks/bench_train.py --configs b8t1024 --ab "$AB" 2>&1 | tee $OUT/runA_bench_train.log | grep -E "cukernels|peak|ab"
