# Run D (session 16, final code): the LLaMA-1B step beside PyTorch in the same process (eager, compile) with the
# memory breakdown; SDPA's backends against ck.flash_attention at the issue-17 attention shapes; the issue-17 kernel rows.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/ckc
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,power.limit,temperature.gpu --format=csv,noheader
python -c "import time; t=time.time(); from cukernels import _loader; _loader.precompile(); print(f'precompile all {time.time()-t:.1f} s')"
timeout 120 python benchmarks/sdpa_backends.py 2>&1 | grep -v Warning | tee $OUT/runD_sdpa.log
el=$(( $(date +%s) - start )); echo "elapsed $el s"
timeout 300 python benchmarks/bench_train.py --configs b8t1024 --steps 20 --vs-torch eager,compile 2>&1 | tee $OUT/runD_bench_train.log | grep -E "cukernels|torch|GiB"
el=$(( $(date +%s) - start )); echo "elapsed $el s"
[ $el -lt 480 ] && timeout $(( 590 - el )) python benchmarks/bench_ops.py --no-startup --quick --only attention_sm90,rms_norm,layer_norm,softmax,linear_cross_entropy 2>&1 | tee $OUT/runD_bench_ops.log | tail -40
echo "elapsed $(( $(date +%s) - start )) s"
