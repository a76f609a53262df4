#!/usr/bin/env bash
# One device call for the whole-step work: graph tests, a smoke pass of every ablation row on a tiny model,
# then the LLaMA-3.2-1B step benchmark (both configs, ablation, PyTorch side by side).
# Usage on the GPU machine:  bash benchmarks/run_train_gpu.sh [--vs-torch eager,compile]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}; mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cukernels-cupy-cache}
python -c "from cukernels import _loader; _loader.precompile()"
timeout 120 python -m pytest -m gpu -q -p no:cacheprovider tests/test_graph.py 2>&1 | tail -n 15
timeout 150 python benchmarks/bench_train.py --smoke --ablation --steps 3 2>&1 | tee "$out/bench_train_smoke.log" | tail -n 25
timeout ${TRAIN_BENCH_TIMEOUT:-420} python benchmarks/bench_train.py --ablation --json "$out/bench_train.json" "$@" 2>&1 | tee "$out/bench_train.log"
