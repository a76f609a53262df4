# Run F (session 16): the CUDA sanitizers over one call of each kernel family's main paths (benchmarks/racecheck_ops.py):
# racecheck (shared-memory hazards), memcheck, synccheck, as time allows.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/ckc
start=$(date +%s)
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1 || true)
echo "compute-sanitizer: ${CS:-none}"; [ -n "$CS" ] && $CS --version | tail -1
python -c "import time; t=time.time(); from cukernels import _loader; _loader.precompile(['rms_norm','layer_norm','softmax','cross_entropy','embedding','rope','activations','dropout','adam','sampling','gemv','graph_fill']); print(f'precompile {time.time()-t:.1f} s')"
timeout 60 python benchmarks/racecheck_ops.py 2>&1 | tail -3 | tee $OUT/runF_plain.log
[ -z "$CS" ] && exit 0
timeout 200 $CS --tool racecheck --racecheck-report all --print-limit 30 python benchmarks/racecheck_ops.py 2>&1 | tee $OUT/runF_racecheck.log | grep -v "^=========     " | tail -60
el=$(( $(date +%s) - start )); echo "elapsed $el s"
[ $el -lt 330 ] && timeout 100 $CS --tool memcheck --print-limit 30 python benchmarks/racecheck_ops.py 2>&1 | tee $OUT/runF_memcheck.log | tail -8
el=$(( $(date +%s) - start )); echo "elapsed $el s"
[ $el -lt 420 ] && timeout 80 $CS --tool synccheck --print-limit 30 python benchmarks/racecheck_ops.py 2>&1 | tee $OUT/runF_synccheck.log | tail -8
echo "elapsed $(( $(date +%s) - start )) s"
