#!/usr/bin/env bash
# One device call for any list of commands: prints the GPUs, runs each command from the repository root with its
# output teed to $OUT/<n>-<slug>.log ($OUT: the device tool's output folder; ./out without it), keeps going after a
# failing command, and ends with one line per command: its exit code and seconds. RUN_TIMEOUT=<s> bounds each one.
#   bash benchmarks/run.sh "python -m pytest -m gpu -q -n 8" "python benchmarks/bench_train.py --configs b8t1024"
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cukernels-cupy-cache}
nvidia-smi --query-gpu=index,name,driver_version,power.limit --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
summary=()
n=0
for cmd in "$@"; do
  n=$((n + 1))
  slug=$(printf '%s' "$cmd" | sed -E 's#(benchmarks|dev|tests)/##g; s#\.py\b##g; s#\bpython( -m)? ##g' \
    | sed -E 's#[^A-Za-z0-9_.]+#-#g; s#^-+|-+$##g' | cut -c1-48)
  log="$out/$n-${slug:-cmd}.log"
  echo "== [$n] $cmd  -> $log"
  t0=$(date +%s%N)
  ${RUN_TIMEOUT:+timeout "$RUN_TIMEOUT"} bash -o pipefail -c "$cmd" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  ds=$(( ($(date +%s%N) - t0) / 100000000 ))
  summary+=("$(printf '[%d] rc %3d %6d.%d s  %s' "$n" "$rc" $((ds / 10)) $((ds % 10)) "$cmd")")
done
echo "== summary"
printf '%s\n' "${summary[@]}"
