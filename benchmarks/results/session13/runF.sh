#!/usr/bin/env bash
# Session 13, run F: the dQ writers' adds as one bulk reduce-add (cp.reduce.async.bulk) a hand-off instead of 1024
# red.global.add.v4; the probe first, then the attention GPU tests, then bench_ops with the A/B row.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cc
out=${OUT:-out}; mkdir -p "$out"
python -c "import time; t=time.time(); from cukernels import _loader; _loader.precompile(['attention_sm90','attention','rope']); print(f'precompile {time.time()-t:.1f} s')"
timeout 30 python -m pytest -m gpu -q -x -p no:cacheprovider tests/test_attention_sm90.py -k "fused_dq_matches and B1Tq1024 and pingpong" > "$out/first.log" 2>&1 || { echo FIRST FAILED; tail -n 30 "$out/first.log"; exit 1; }
tail -n 1 "$out/first.log"
timeout 40 python benchmarks/fused_dq_probe.py 2>&1 | tee "$out/probe.log"
timeout 150 python -m pytest -m gpu -q -p no:cacheprovider -n 8 tests/test_attention_sm90.py tests/test_attention.py 2>&1 | tee "$out/tests.log" | grep -E "passed|failed|FAILED|ERROR|Error" | tail -n 30
timeout 100 python benchmarks/bench_ops.py --no-startup --quick --only attention_sm90 --ab "attention_sm90.BWD_DQ=kernel" 2>&1 | tee "$out/bench.log" | grep -E "bwd|BWD"
