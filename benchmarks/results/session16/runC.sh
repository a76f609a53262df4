# Run C (session 16): the whole GPU suite on the memset rewrite + the rope's nearest-multiple head chunks (fail fast
# on the graph and rope tests), the rope rows again, and the memset A/B rows on GPT-2 and on B4xT64 bf16 gradients.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/ckc
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,power.limit,temperature.gpu --format=csv,noheader
python -c "import time; t=time.time(); from cukernels import _loader; _loader.precompile(); print(f'precompile all {time.time()-t:.1f} s')"
timeout 120 python -m pytest -m gpu -q -p no:cacheprovider -x -n 8 tests/test_graph.py tests/test_rope.py 2>&1 | tail -3 | tee $OUT/runC_first.log
grep -q "failed\|error" $OUT/runC_first.log && { echo "FIRST TEST FAILED"; exit 1; }
timeout 280 python -m pytest -m gpu -q -p no:cacheprovider -n 8 2>&1 | tee $OUT/runC_gpu_tests.log | grep -E "passed|failed|FAILED|ERROR" | tail -30
el=$(( $(date +%s) - start )); echo "elapsed $el s"
timeout 40 python benchmarks/bench_ops.py --no-startup --quick --only rope --ab "rope.HEAD_ROUND=1" 2>&1 | tee $OUT/runC_bench_rope.log | grep -E -A1 "^rope" | grep -v "^--"
M0="graph.MEMSET_NODES=keep"; M1="graph.MEMSET_NODES=kernel"
el=$(( $(date +%s) - start )); echo "elapsed $el s"
[ $el -lt 470 ] && timeout 70 python benchmarks/bench_train.py --model gpt2 --steps 20 --ab "$M0;$M1;$M0" 2>&1 | tee $OUT/runC_gpt2.log | grep -E "cukernels"
el=$(( $(date +%s) - start )); echo "elapsed $el s"
BF="__main__.GRAD_BF16=1"
[ $el -lt 530 ] && timeout 60 python benchmarks/bench_train.py --configs b4t64 --steps 30 --ab "$BF;$BF,$M0;$BF,$M1;$BF,$M0" 2>&1 | tee $OUT/runC_b4t64_bf16.log | grep -E "cukernels"
echo "elapsed $(( $(date +%s) - start )) s"
