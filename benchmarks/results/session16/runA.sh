# Run A (session 16): the memset-node rewrite (fail fast on its GPU tests), what cuBLAS' memsets are, the step A/B
# rows interleaved (B4xT64, B8xT1024), the packed rope, then as much of the GPU suite as time allows.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/ckc
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,power.limit,temperature.gpu --format=csv,noheader
python -c "import time; t=time.time(); from cukernels import _loader; _loader.precompile(); print(f'precompile all {time.time()-t:.1f} s')"
timeout 120 python -m pytest -m gpu -q -p no:cacheprovider -x tests/test_graph.py 2>&1 | tail -15 | tee $OUT/runA_first.log
grep -q "failed\|error" $OUT/runA_first.log && { echo "FIRST TEST FAILED"; exit 1; }
timeout 60 python benchmarks/graph_memsets.py 2>&1 | tee $OUT/runA_memsets.log
M0="graph.MEMSET_NODES=keep"; M1="graph.MEMSET_NODES=kernel"
timeout 100 python benchmarks/bench_train.py --configs b4t64 --steps 30 --ab "$M0;$M1;$M0" 2>&1 | tee $OUT/runA_b4t64.log | grep -E "cukernels"
el=$(( $(date +%s) - start )); echo "elapsed $el s"
timeout 170 python benchmarks/bench_train.py --configs b8t1024 --steps 20 --ab "$M0;$M1;$M0" 2>&1 | tee $OUT/runA_b8t1024.log | grep -E "cukernels"
el=$(( $(date +%s) - start )); echo "elapsed $el s"
timeout 40 python benchmarks/bench_ops.py --no-startup --quick --only rope --ab "rope.HEAD_ROUND=1" 2>&1 | tee $OUT/runA_bench_rope.log | grep -E -A1 "packed|8x2048x32x64 +bf16" | grep -v "^--"
el=$(( $(date +%s) - start )); echo "elapsed $el s"
[ $el -lt 480 ] && timeout $(( 590 - el )) python -m pytest -m gpu -q -p no:cacheprovider -n 8 -x tests/test_attention_sm90.py tests/test_rope.py tests/test_graph.py 2>&1 | tee $OUT/runA_tests.log | grep -E "passed|failed|FAILED|ERROR" | tail -10
echo "elapsed $(( $(date +%s) - start )) s"
