#!/usr/bin/env bash
# Session 13, run D: the fused backward with dQ writer warps: attention GPU tests, the kernel probe, bench_ops A/B.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cc
out=${OUT:-out}; mkdir -p "$out"
python -c "import time; t=time.time(); from cukernels import _loader; _loader.precompile(['attention_sm90','attention','rope']); print(f'precompile {time.time()-t:.1f} s')"
timeout 60 python -m pytest -m gpu -q -x -p no:cacheprovider tests/test_attention_sm90.py -k "fused_dq_matches and B1Tq1024" 2>&1 | tail -n 15 | tee "$out/first.log"
timeout 60 python benchmarks/fused_dq_probe.py 2>&1 | tee "$out/probe.log"
timeout 240 python -m pytest -m gpu -q -p no:cacheprovider -n 8 tests/test_attention_sm90.py tests/test_attention.py 2>&1 | tee "$out/tests.log" | grep -E "passed|failed|FAILED|ERROR|Error" | tail -n 40
timeout 200 python benchmarks/bench_ops.py --no-startup --quick --only attention_sm90 --ab "attention_sm90.BWD_DQ=kernel" 2>&1 | tee "$out/bench.log" | grep -E "bwd|fwd\+bwd|BWD" 
