# Run F (session 15): DQ_DIRECT (the fused attention backward's last key tile writes dq). Fail-fast test first,
# then the whole GPU suite, then attention fwd+bwd A/B (bench_ops) and the LLaMA-1B step A/B, rows interleaved.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/ckc
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.limit,temperature.gpu --format=csv,noheader
python -c "import time; t=time.time(); from cukernels import _loader; _loader.precompile(); print(f'precompile all {time.time()-t:.1f} s')"
timeout 100 python -m pytest -m gpu -q -p no:cacheprovider -x tests/test_attention_sm90.py -k "direct" 2>&1 | tail -3 | tee $OUT/runF_first.log
grep -q " passed" $OUT/runF_first.log && ! grep -q "failed" $OUT/runF_first.log || { echo "FIRST TEST FAILED"; exit 1; }
timeout 300 python -m pytest -m gpu -q -p no:cacheprovider -n 8 2>&1 | tee $OUT/runF_gpu_tests.log | grep -E "passed|failed|FAILED|ERROR" | tail -30
timeout 90 python benchmarks/bench_ops.py --no-startup --only attention_sm90 --ab "attention_sm90.DQ_DIRECT=0" 2>&1 | tee $OUT/runF_bench_ops.log | grep -E -A1 "fwd\+bwd" | grep -v "^--" | head -30
D1="attention_sm90.DQ_DIRECT=1"; D0="attention_sm90.DQ_DIRECT=0"
timeout 150 python benchmarks/bench_train.py --configs b8t1024 --steps 20 --ab "$D0;$D1;$D0;$D1" 2>&1 | tee $OUT/runF_bench_train.log | grep -E "cukernels"
