#!/usr/bin/env bash
# One device call per stage, logs in $OUT (the device tool's output folder) or ./out.
#   bash benchmarks/run_session.sh tests [pytest args]   GPU suite (-m gpu, 8 workers) + kernel compile check
#   bash benchmarks/run_session.sh ops FAMILIES          bench_ops --quick for a comma list of families
#   bash benchmarks/run_session.sh train [args]          bench_train (LLaMA both configs) + GPT-2 with PyTorch
#   bash benchmarks/run_session.sh dist [configs]        (2 GPUs) distributed tests + bench_train 1 GPU vs --nproc 2
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}; mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cukernels-cupy-cache}
stage=${1:-tests}; shift || true
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1
case "$stage" in s6g|s7*|s8*|s9*|s1[0-9]*) ;; *) python -c "import time; t=time.time(); from cukernels import _loader; _loader.precompile(); print(f'precompile {time.time()-t:.1f} s')" ;; esac
# the families a training step uses (no gemv: its ~100 s compile is the long pole)
TRAIN_FAMS="['adam','attention','attention_sm90','cross_entropy','elementwise','embedding','rms_norm','rope','activations','softmax','layer_norm','dropout']"
case "$stage" in
  tests)
    timeout ${GPU_TEST_TIMEOUT:-420} python -m pytest -m gpu -q -p no:cacheprovider -n 8 "$@" 2>&1 \
      | tee "$out/gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR|Error" | tail -n 80 ;;
  ops)
    timeout ${BENCH_TIMEOUT:-500} python benchmarks/bench_ops.py --no-startup --quick --only "$1" \
      --json "$out/bench_ops.json" 2>&1 | tee "$out/bench_ops.log" ;;
  train)
    timeout 240 python benchmarks/bench_train.py --configs b4t64,b8t1024 --json "$out/bench_llama.json" 2>&1 \
      | tee "$out/bench_llama.log"
    timeout 330 python benchmarks/bench_train.py --model gpt2 --ablation --vs-torch "${1:-eager,compile,reduce-overhead}" \
      --json "$out/bench_gpt2.json" 2>&1 | tee "$out/bench_gpt2.log" ;;
esac
if [ "$stage" = "profile" ]; then
  timeout 300 python benchmarks/profile_step.py --model "${1:-gpt2}" --configs "${2:-b8t1024}" --top 45 2>&1 \
    | grep -v "^STAGE\|Warning\|warn(" | tee "$out/profile.log"
  [ -n "${3:-}" ] && timeout 280 python benchmarks/bench_train.py --model gpt2 --vs-torch "$3" --json "$out/bench_gpt2.json" 2>&1 | tee "$out/bench_gpt2.log"
fi
if [ "$stage" = "gen" ]; then
  timeout 280 python benchmarks/bench_generate.py --model llama ${1:+$1} 2>&1 | tee "$out/bench_generate_llama.log"
  timeout 150 python benchmarks/bench_generate.py --model gpt2 --batches 1,8,64 --prompts 128 --generic 2>&1 | tee "$out/bench_generate_gpt2.log"
fi
if [ "$stage" = "gpt2" ]; then
  timeout 200 python benchmarks/bench_train.py --model gpt2 ${1:+--vs-torch $1} --json "$out/bench_gpt2.json" 2>&1 | tee "$out/bench_gpt2.log"
  timeout 200 python benchmarks/profile_step.py --model gpt2 --configs b8t1024 --top 30 2>&1 | grep -v "Warning\|warn" | tee "$out/profile_gpt2.log"
fi
if [ "$stage" = "dist" ]; then  # the 2-GPU machine: 2-GPU tests, then 1 GPU vs 2 GPUs on the LLaMA-1B shape
  timeout ${DIST_TEST_TIMEOUT:-240} python -m pytest -m gpu -q -p no:cacheprovider tests/test_distributed.py \
    tests/test_zero.py tests/test_train_distributed.py 2>&1 | tee "$out/dist_tests.log" | tail -n 40
  timeout 150 python benchmarks/bench_train.py --configs ${1:-b8t1024,b4t64} --json "$out/bench_1gpu.json" 2>&1 \
    | tee "$out/bench_1gpu.log"
  timeout 200 python benchmarks/bench_train.py --configs ${1:-b8t1024,b4t64} --nproc 2 --json "$out/bench_2gpu.json" \
    2>&1 | tee "$out/bench_2gpu.log"
fi
if [ "$stage" = "genprof" ]; then  # where a decode step's time goes (eager kernel times + captured wall time)
  timeout 120 python benchmarks/profile_generate.py --model llama --top ${1:-30} 2>&1 | grep -v "Warning\|warn(" \
    | tee "$out/profile_generate_llama.log"
  timeout 60 python benchmarks/profile_generate.py --model gpt2 --top 15 2>&1 | grep -v "Warning\|warn(" \
    | tee "$out/profile_generate_gpt2.log"
fi
if [ "$stage" = "s4a" ]; then  # session 4, call A (2-GPU machine): wgmma smoke + tests, the GPU suite, 2-GPU bench
  timeout 120 python -m pytest -q -p no:cacheprovider --tb=short tests/test_attention_sm90.py -k smoke 2>&1 \
    | tee "$out/sm90_smoke.log" | tail -n 15
  timeout 200 python -m pytest -q -p no:cacheprovider --tb=line -n 4 tests/test_attention_sm90.py 2>&1 \
    | tee "$out/sm90_tests.log" | tail -n 12
  timeout 330 python -m pytest -m gpu -q -p no:cacheprovider -n 8 --ignore=tests/test_attention_sm90.py 2>&1 \
    | tee "$out/gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR|Error" | tail -n 60
  timeout 150 python benchmarks/bench_train.py --configs b8t1024,b4t64 --nproc 2 --sm-margin ${1:-16} \
    --json "$out/bench_2gpu.json" 2>&1 | tee "$out/bench_2gpu.log" | grep "ms/step"
fi
if [ "$stage" = "s4b" ]; then  # session 4, call B: kernel benches, generation vs transformers, the 1-GPU step
  timeout 75 python -m pytest -m gpu -q -p no:cacheprovider -n 8 tests/test_gemv.py tests/test_embedding.py \
    tests/test_linear_cross_entropy.py tests/test_attention_sm90.py "tests/test_decode_attention.py" \
    "tests/test_rms_norm.py::test_gpu_add_captures_in_a_graph" 2>&1 | tee "$out/gpu_tests_rerun.log" \
    | grep -E "passed|failed|FAILED|ERROR" | tail -n 30
  timeout 170 python benchmarks/bench_ops.py --no-startup --quick --only "${1:-rms_norm,layer_norm,softmax,activations,embedding,gemv,decode_attention,linear_cross_entropy,attention_sm90}" \
    --json "$out/bench_ops.json" > "$out/bench_ops.log" 2>&1; tail -n 80 "$out/bench_ops.log"
  timeout 150 python benchmarks/bench_generate.py --model llama --vs-hf --generic 2>&1 | tee "$out/bench_generate_llama.log"
  timeout 40 python benchmarks/bench_generate.py --model gpt2 --batches 1,8,64 --prompts 128 --generic 2>&1 \
    | tee "$out/bench_generate_gpt2.log"
  timeout 110 python benchmarks/bench_train.py --configs b4t64,b8t1024 --json "$out/bench_llama.json" 2>&1 \
    | tee "$out/bench_llama.log" | grep -v "^    "
fi
if [ "$stage" = "s5a" ]; then  # session 5, call A: the GPU suite on HEAD, the fused decode profile, unmeasured rows
  timeout 330 python -m pytest -m gpu -q -p no:cacheprovider -n 8 --tb=line 2>&1 \
    | tee "$out/gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR|Error" | tail -n 60
  timeout 90 python benchmarks/profile_generate.py --model llama --top 30 2>&1 | grep -v "Warning\|warn(" \
    | tee "$out/profile_generate_llama.log"
  timeout 200 python benchmarks/bench_ops.py --no-startup --only gemv,softmax,linear_cross_entropy \
    --json "$out/bench_ops.json" > "$out/bench_ops.log" 2>&1; grep -v "^ *$" "$out/bench_ops.log" | tail -n 60
fi
if [ "$stage" = "s5b" ]; then  # session 5, call B: PDL + the B = 1 GEMV tiles (tests, kernel rows, the step)
  timeout 150 python -m pytest -m gpu -q -p no:cacheprovider -n 8 --tb=short tests/test_launch.py tests/test_gemv.py \
    tests/test_generate.py 2>&1 | tee "$out/gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR|Error|error" | tail -n 30
  timeout 100 python benchmarks/bench_ops.py --no-startup --quick --only gemv --json "$out/bench_ops.json" \
    > "$out/bench_ops.log" 2>&1; grep -E "^gemv" "$out/bench_ops.log"
  timeout 120 python benchmarks/bench_generate.py --model llama --batches 1 --prompts 128 --pdl-ab --generic 2>&1 \
    | tee "$out/bench_generate_llama.log"
  timeout 90 python benchmarks/profile_generate.py --model llama --top 14 2>&1 | grep -v "Warning\|warn(" \
    | tee "$out/profile_generate_llama.log"
fi
if [ "$stage" = "s5c" ]; then  # session 5, call C: the one-launch decode attention, greedy across blocks, gemv1
  timeout 200 python -m pytest -m gpu -q -p no:cacheprovider -n 8 --tb=short tests/test_launch.py tests/test_gemv.py \
    tests/test_generate.py tests/test_decode_attention.py tests/test_sampling.py 2>&1 | tee "$out/gpu_tests.log" \
    | grep -E "passed|failed|FAILED|ERROR|Error|error" | tail -n 40
  timeout 150 python benchmarks/bench_ops.py --no-startup --quick --only gemv,decode_attention,sampling \
    --json "$out/bench_ops.json" > "$out/bench_ops.log" 2>&1; grep -E "^(gemv|decode|sample)" "$out/bench_ops.log"
  timeout 120 python benchmarks/bench_generate.py --model llama --batches 1 --prompts 128 --pdl-ab 2>&1 \
    | tee "$out/bench_generate_llama.log"
  timeout 90 python benchmarks/profile_generate.py --model llama --top 14 2>&1 | grep -v "Warning\|warn(" \
    | tee "$out/profile_generate_llama.log"
fi
if [ "$stage" = "s5d1" ]; then  # session 5, call D1: the whole GPU suite, the GEMV / sampling / attention rows
  timeout 280 python -m pytest -m gpu -q -p no:cacheprovider -n 8 --tb=line 2>&1 \
    | tee "$out/gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR|Error" | tail -n 50
  timeout 90 python benchmarks/bench_ops.py --no-startup --only gemv --json "$out/bench_gemv.json" \
    > "$out/bench_gemv.log" 2>&1; grep -E "^gemv .*B1" "$out/bench_gemv.log"
  timeout 60 python benchmarks/bench_ops.py --no-startup --quick --only sampling,decode_attention \
    --json "$out/bench_ops.json" > "$out/bench_ops.log" 2>&1; grep -E "greedy  |B1 len" "$out/bench_ops.log"
fi
if [ "$stage" = "s5d2" ]; then  # session 5, call D2: generation, ours vs transformers, LLaMA-1B and GPT-2
  timeout 330 python benchmarks/bench_generate.py --model llama --pdl-ab --generic --vs-hf 2>&1 \
    | grep -v "Warning\|warn" | tee "$out/bench_generate_llama.log"
  timeout 60 python benchmarks/bench_generate.py --model gpt2 --batches 1,8,64 --prompts 128 --generic 2>&1 \
    | tee "$out/bench_generate_gpt2.log"
  timeout 60 python benchmarks/profile_generate.py --model llama --top 10 2>&1 | grep -v "Warning\|warn(" \
    | tee "$out/profile_generate_llama.log"
fi
if [ "$stage" = "s5e" ]; then  # session 5, call E: the fixed gemv1 (tests, B1 rows, the step A/B, profile)
  timeout 120 python -m pytest -m gpu -q -p no:cacheprovider -n 8 --tb=short tests/test_launch.py tests/test_gemv.py \
    tests/test_generate.py 2>&1 | tee "$out/gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR|Error|error" | tail -n 20
  timeout 90 python benchmarks/bench_ops.py --no-startup --only gemv --json "$out/bench_gemv.json" \
    > "$out/bench_gemv.log" 2>&1; grep -E "^gemv .*B1" "$out/bench_gemv.log"
  timeout 100 python benchmarks/bench_generate.py --model llama --batches 1 --prompts 128 --pdl-ab 2>&1 \
    | tee "$out/bench_generate_llama.log"
  timeout 60 python benchmarks/profile_generate.py --model llama --top 12 2>&1 | grep -v "Warning\|warn(" \
    | tee "$out/profile_generate_llama.log"
fi
if [ "$stage" = "s5f" ]; then  # session 5, call F: L2 prefetch before the wait (tests, rows, the step A/B, profile)
  timeout 120 python -m pytest -m gpu -q -p no:cacheprovider -n 8 --tb=short tests/test_launch.py tests/test_gemv.py \
    tests/test_generate.py tests/test_decode_attention.py 2>&1 | tee "$out/gpu_tests.log" \
    | grep -E "passed|failed|FAILED|ERROR|Error|error" | tail -n 20
  timeout 90 python benchmarks/bench_ops.py --no-startup --only gemv,decode_attention --json "$out/bench_ops.json" \
    > "$out/bench_ops.log" 2>&1; grep -E "^gemv .*B1|^decode_attention +B1" "$out/bench_ops.log"
  timeout 100 python benchmarks/bench_generate.py --model llama --batches 1 --prompts 128 --pdl-ab 2>&1 \
    | tee "$out/bench_generate_llama.log"
  timeout 60 python benchmarks/profile_generate.py --model llama --top 12 2>&1 | grep -v "Warning\|warn(" \
    | tee "$out/profile_generate_llama.log"
fi
if [ "$stage" = "s5i" ]; then  # session 5, call I: the model built in its own pool (trainer GPU tests, B4xT64 memory)
  timeout 120 python -m pytest -m gpu -q -p no:cacheprovider -n 4 --tb=short tests/test_graph.py tests/test_gpt2.py 2>&1 \
    | tee "$out/gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR|Error" | tail -n 15
  timeout 150 python benchmarks/bench_train.py --configs b4t64 --json "$out/bench_llama.json" 2>&1 \
    | tee "$out/bench_llama.log" | grep -v "^ *$"
fi
if [ "$stage" = "ncu" ]; then  # hardware counters of the B = 1 decode GEMV at qkv's shape (Firecracker runtime only:
  # on gVisor ncu cannot read counters, KINDS.md); the question of session 5: what holds its ~5 us fixed cost
  cat > /tmp/gemv_drive.py <<'PY'
import cupy as cp
import cukernels as ck
K, N = 2048, int(__import__("os").environ.get("GEMV_N", "3072"))
x = cp.random.standard_normal((1, K), dtype=cp.float32).astype(ck.bfloat16)
w = (cp.random.standard_normal((N, K), dtype=cp.float32) * K ** -0.5).astype(ck.bfloat16)
nw = cp.ones(K, dtype=cp.float32)
norm = __import__("os").environ.get("GEMV_NORM", "rms") or None
for _ in range(4):
    ck.gemv(x, w, norm=norm, norm_weight=nw if norm else None)
cp.cuda.Device().synchronize()
PY
  timeout 240 ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:gemv_bf16 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
    --section LaunchStats --section Occupancy python /tmp/gemv_drive.py 2>&1 | tee "$out/ncu_gemv_qkv.log" | tail -n 120
fi
if [ "$stage" = "s6a" ]; then  # session 6, call A: GPU suite (+ the ftz branch), the GEMV chain A/B, ncu, the step
  timeout 280 python -m pytest -m gpu -q -p no:cacheprovider -n 8 --tb=line 2>&1 \
    | tee "$out/gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR|Error" | tail -n 40
  timeout 60 python benchmarks/gemv_chain.py 2>&1 | tee "$out/gemv_chain.log"
  cat > /tmp/gemv_drive.py <<'PY'
import os, cupy as cp, cukernels as ck
K, N = int(os.environ.get("GEMV_K", "2048")), int(os.environ.get("GEMV_N", "3072"))
x = cp.random.standard_normal((1, K), dtype=cp.float32).astype(ck.bfloat16)
w = (cp.random.standard_normal((N, K), dtype=cp.float32) * K ** -0.5).astype(ck.bfloat16)
nw = cp.ones(K, dtype=cp.float32)
norm = os.environ.get("GEMV_NORM", "rms") or None
for _ in range(4):
    ck.gemv(x, w, norm=norm, norm_weight=nw if norm else None)
cp.cuda.Device().synchronize()
PY
  for cfg in "3072 rms" "3072 " ; do
    set -- $cfg; n=$1; nm=${2:-}
    GEMV_N=$n GEMV_NORM=$nm timeout 150 ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:gemv_bf16 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
      --section LaunchStats --section Occupancy --section SourceCounters python /tmp/gemv_drive.py \
      > "$out/ncu_gemv_${n}_${nm:-none}.log" 2>&1
    grep -E "Duration|Throughput|Stall|Warp Cycles|Issued|Achieved Occ|Registers|Eligible|Active Warps|L2 Hit|smsp__pcsamp" "$out/ncu_gemv_${n}_${nm:-none}.log" | head -n 45
  done
  timeout 120 python benchmarks/bench_generate.py --model llama --batches 1 --prompts 128 2>&1 \
    | tee "$out/bench_generate_llama.log" | grep -v "Warning\|warn"
  timeout 60 python benchmarks/profile_generate.py --model llama --top 12 2>&1 | grep -v "Warning\|warn(" \
    | tee "$out/profile_generate_llama.log"
fi
if [ "$stage" = "s6b" ]; then  # session 6, call B: the GEMV's cp.async ring + one-pass prologue (tests, chain, step)
  timeout 200 python -m pytest -m gpu -q -p no:cacheprovider -n 8 --tb=short tests/test_gemv.py tests/test_launch.py \
    tests/test_generate.py 2>&1 | tee "$out/gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR|Error|error" | tail -n 30
  timeout 60 python benchmarks/gemv_chain.py 2>&1 | tee "$out/gemv_chain.log"
  for d in 2 4; do GEMV_DEPTH=$d timeout 60 python benchmarks/gemv_chain.py 2>&1 | tee "$out/gemv_chain_d$d.log"; done
  timeout 120 python benchmarks/bench_generate.py --model llama --batches 1 --prompts 128 --pdl-ab 2>&1 \
    | tee "$out/bench_generate_llama.log" | grep -v "Warning\|warn"
  timeout 60 python benchmarks/profile_generate.py --model llama --top 8 2>&1 | grep -v "Warning\|warn(" \
    | tee "$out/profile_generate_llama.log"
fi
if [ "$stage" = "s6c" ]; then  # session 6, call C: ring A/B in the step (blocks a SM, carveout, depth), chain, tests
  timeout 150 python benchmarks/bench_generate.py --model llama --batches 1 --prompts 128 \
    --ab "gemv.BLOCKS_PER_SM=0;_launch.CARVEOUT=-1;gemv.DEPTH=2;gemv.DEPTH=4;gemv.PREFETCH_KB=0;gemv.BLOCKS_PER_SM=1" 2>&1 \
    | tee "$out/bench_generate_llama.log" | grep -v "Warning\|warn"
  timeout 60 python benchmarks/gemv_chain.py 2>&1 | tee "$out/gemv_chain.log"
  timeout 120 python -m pytest -m gpu -q -p no:cacheprovider -n 8 --tb=short tests/test_gemv.py tests/test_launch.py \
    tests/test_generate.py 2>&1 | tee "$out/gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR|Error|error" | tail -n 30
fi
if [ "$stage" = "s6d" ]; then  # session 6, call D: the whole GPU suite, then generation and the decode kernel rows
  timeout 280 python -m pytest -m gpu -q -p no:cacheprovider -n 8 --tb=line 2>&1 \
    | tee "$out/gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR|Error" | tail -n 40
  timeout 150 python benchmarks/bench_generate.py --model llama --pdl-ab --ab "${1:-decode.FUSED_ATTENTION=0;_launch.CARVEOUT=-1;gemv.PREFETCH_KB=0;gemv.DEPTH_LONG=3}" 2>&1 \
    | grep -v "Warning\|warn" | tee "$out/bench_generate_llama.log"
  timeout 60 python benchmarks/bench_generate.py --model gpt2 --batches 1,8,64 --prompts 128 2>&1 \
    | grep -v "Warning\|warn" | tee "$out/bench_generate_gpt2.log"
  timeout 100 python benchmarks/bench_ops.py --no-startup --quick --only gemv,decode_attention \
    --json "$out/bench_ops.json" > "$out/bench_ops.log" 2>&1; grep -E "^(gemv|decode)" "$out/bench_ops.log" | head -40
  timeout 60 python benchmarks/profile_generate.py --model llama --top 8 2>&1 | grep -v "Warning\|warn(" \
    | tee "$out/profile_generate_llama.log"
fi
if [ "$stage" = "s6e" ]; then  # session 6, call E: the B1 step again (spread), against transformers in its own process
  timeout 330 python benchmarks/bench_generate.py --model llama --batches 1 --prompts 128,2048 --vs-hf \
    --ab "gemv.PREFETCH_KB=0;gemv.PREFETCH_KB=4;decode.FUSED_ATTENTION=0;gemv.PREFETCH_KB=4" 2>&1 \
    | grep -v "Warning\|warn" | tee "$out/bench_generate_llama.log"
fi
if [ "$stage" = "s6f" ]; then  # session 6, call F: the decode table with medians of 3 runs a row
  timeout 200 python benchmarks/bench_generate.py --model llama --batches 1,8 --prompts 128,2048 \
    --ab "decode.FUSED_ATTENTION=0;_launch.PDL=0" 2>&1 | grep -v "Warning\|warn" | tee "$out/bench_generate_llama.log"
fi
if [ "$stage" = "s6g" ]; then  # session 6, call G: the review's kernel edits (sampling helper, gemv launch bounds note)
  python -c "from cukernels import _loader; _loader.precompile(['gemv', 'sampling', 'decode_attention', 'rope', 'embedding', 'rms_norm', 'elementwise'])"
  timeout 200 python -m pytest -m gpu -q -p no:cacheprovider -n 8 --tb=short tests/test_sampling.py tests/test_gemv.py \
    tests/test_decode_attention.py tests/test_generate.py tests/test_launch.py 2>&1 | tee "$out/gpu_tests.log" \
    | grep -E "passed|failed|FAILED|ERROR|Error" | tail -n 20
fi
if [ "$stage" = "s7a" ]; then  # session 7, call A (2 GPUs): where the 2-GPU step's time goes
  python -c "import time; t=time.time(); from cukernels import _loader; _loader.precompile($TRAIN_FAMS); print(f'precompile {time.time()-t:.1f} s')"
  NCCL_DEBUG=INFO timeout 60 python -m cukernels.run --nproc-per-node 2 benchmarks/bench_dist.py --skip-step \
    --sizes 1.34e8,1.5e9 --repeats 3 > "$out/coll_default.log" 2>&1; grep -E "^\[rank 0\] \|" "$out/coll_default.log"
  grep -m3 -iE "nchannels|channels? [0-9]+/[0-9]+" "$out/coll_default.log"
  for c in 4 8; do
    NCCL_MAX_NCHANNELS=$c NCCL_MAX_CTAS=$c timeout 45 python -m cukernels.run --nproc-per-node 2 benchmarks/bench_dist.py \
      --skip-step --sizes 1.34e8,1.5e9 --repeats 3 2>&1 | tee "$out/coll_ch$c.log" | grep -E "reduce_scatter|all_gather" | sed "s/^/ch$c /"
  done
  timeout 330 python benchmarks/bench_train.py --configs b4t64,b8t1024 --nproc 2 --steps 8 --timeline "$out/tl" \
    --ab "${1:-zero.ADAM_OCCUPANCY=8}" --json "$out/bench_2gpu.json" 2>&1 | grep -v "^\[rank 0\]     " | tee "$out/bench_2gpu.log"
  NCCL_MAX_NCHANNELS=4 NCCL_MAX_CTAS=4 timeout 110 python benchmarks/bench_train.py --configs b8t1024 --nproc 2 --steps 8 \
    --sm-margin 4 --timeline "$out/tl_ch4" 2>&1 | grep -v "^\[rank 0\]     " | tee "$out/bench_2gpu_ch4.log"
fi
if [ "$stage" = "s7b" ]; then  # session 7, call B (2 GPUs): the B8xT1024 timeline, bf16 vs fp32 wire, 1 GPU beside
  python -c "from cukernels import _loader; _loader.precompile($TRAIN_FAMS)"
  timeout 120 python benchmarks/bench_train.py --configs b8t1024 --nproc 2 --steps 8 --timeline "$out/tl" \
    ${1:+--ab "$1"} 2>&1 | grep -v "^\[rank 0\]     " | tee "$out/bench_2gpu.log"
  timeout 120 python benchmarks/bench_train.py --configs b8t1024 --nproc 2 --steps 8 --wire fp32 --timeline "$out/tl32" \
    2>&1 | grep -v "^\[rank 0\]     " | grep -v "^\[rank 0\]   [a-z]" | tee "$out/bench_2gpu_fp32.log"
  timeout 100 python benchmarks/bench_train.py --configs b8t1024 --steps 8 --timeline "$out/tl1" 2>&1 \
    | grep -v "^     " | tee "$out/bench_1gpu.log"
  tar czf "$out/timelines.tgz" -C "$out" tl tl32 tl1 && rm -rf "$out/tl" "$out/tl32" "$out/tl1"
fi
if [ "$stage" = "s7c" ]; then  # session 7, call C (2 GPUs): lazy zero + deferred shadow gathers, tests and the table
  python -c "from cukernels import _loader; _loader.precompile($TRAIN_FAMS)"
  timeout 230 python -m pytest -m gpu -q -p no:cacheprovider --tb=short tests/test_zero.py tests/test_train_distributed.py \
    tests/test_distributed.py tests/test_adam.py 2>&1 | tee "$out/dist_tests.log" | grep -E "passed|failed|FAILED|ERROR|Error" | tail -n 20
  timeout 200 python benchmarks/bench_train.py --configs b8t1024,b4t64 --nproc 2 --steps 10 --timeline "$out/tl" \
    --ab "${1:-__main__.ZERO_OVERLAP_GATHER=0;zero.EAGER_GATHERS=0}" --json "$out/bench_2gpu.json" 2>&1 \
    | grep -v "^\[rank 0\]     \|Warning\|_warn_once" | tee "$out/bench_2gpu.log"
  timeout 100 python benchmarks/bench_train.py --configs b8t1024,b4t64 --steps 10 --json "$out/bench_1gpu.json" 2>&1 \
    | grep -v "^     " | tee "$out/bench_1gpu.log"
  tar czf "$out/timelines.tgz" -C "$out" tl && rm -rf "$out/tl"
fi
if [ "$stage" = "s7d" ]; then  # session 7, call D (2 GPUs): queued steps; NCCL protocol / channel count beside compute
  python -c "from cukernels import _loader; _loader.precompile($TRAIN_FAMS)"
  timeout 60 python benchmarks/bench_train.py --configs b8t1024 --steps 8 2>&1 | grep "ms/step" | tee "$out/bench_1gpu.log"
  for env in "X=1" "NCCL_PROTO=Simple" "NCCL_PROTO=Simple NCCL_MAX_NCHANNELS=8 NCCL_MAX_CTAS=8" "NCCL_MAX_NCHANNELS=12 NCCL_MAX_CTAS=12" "NCCL_PROTO=LL128"; do
    echo "== $env"
    env $env timeout 75 python benchmarks/bench_train.py --configs b8t1024 --nproc 2 --steps 8 --timeline "$out/tl_$(echo $env | tr ' =' '__')" 2>&1 \
      | grep -E "ms/step|^\[rank 0\] timeline" | tee -a "$out/bench_2gpu.log"
  done
  tar czf "$out/timelines.tgz" -C "$out" $(cd "$out" && ls -d tl_*) && rm -rf "$out"/tl_*
fi
if [ "$stage" = "s7e" ]; then  # session 7, call E (2 GPUs): the whole GPU suite on the final code (2-GPU tests included)
  python -c "import time; t=time.time(); from cukernels import _loader; _loader.precompile(); print(f'precompile {time.time()-t:.1f} s')"
  timeout ${GPU_TEST_TIMEOUT:-420} python -m pytest -m gpu -q -p no:cacheprovider -n 8 --tb=line 2>&1 \
    | tee "$out/gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR|Error" | tail -n 40
fi
if [ "$stage" = "s7f" ]; then  # session 7, call F (2 GPUs): where the wire cast runs, bucket size, fp32 wire
  python -c "from cukernels import _loader; _loader.precompile($TRAIN_FAMS)"
  timeout 300 python benchmarks/bench_train.py --configs b4t64,b8t1024 --nproc 2 --steps 10 \
    --ab "${1:-zero.CAST_ON_COMPUTE_STREAM=1;__main__.ZERO_BUCKET=134217728;zero.CAST_ON_COMPUTE_STREAM=1,__main__.ZERO_BUCKET=134217728}" \
    --json "$out/bench_2gpu.json" 2>&1 | grep "ms/step" | tee "$out/bench_2gpu.log"
  timeout 120 python benchmarks/bench_train.py --configs b4t64,b8t1024 --nproc 2 --steps 10 --wire fp32 2>&1 \
    | grep "ms/step" | tee "$out/bench_2gpu_fp32.log"
  timeout 60 python -m pytest -m gpu -q -p no:cacheprovider tests/test_zero.py -k two_gpus 2>&1 | tail -n 2
fi
if [ "$stage" = "s7g" ]; then  # session 7, call G (2 GPUs): the final table, 1 GPU beside; 2-GPU tests on the defaults
  python -c "from cukernels import _loader; _loader.precompile($TRAIN_FAMS)"
  timeout 150 python -m pytest -m gpu -q -p no:cacheprovider tests/test_zero.py tests/test_train_distributed.py 2>&1 | tail -n 2
  timeout 90 python benchmarks/bench_train.py --configs b8t1024,b4t64 --steps 10 --json "$out/bench_1gpu.json" 2>&1 \
    | grep "ms/step" | tee "$out/bench_1gpu.log"
  timeout 200 python benchmarks/bench_train.py --configs b8t1024,b4t64 --nproc 2 --steps 10 \
    --ab "${1:-zero.CAST_ON_COMPUTE_STREAM=0;__main__.ZERO_BUCKET=134217728}" --json "$out/bench_2gpu.json" 2>&1 \
    | grep -v "^\[rank 0\]     \|Warning\|_warn_once" | tee "$out/bench_2gpu.log"
fi
if [ "$stage" = "s7h" ]; then  # session 7, call H (2 GPUs): GPU time of one replay by rank; graph node / side priorities
  python -c "from cukernels import _loader; _loader.precompile($TRAIN_FAMS)"
  timeout 60 python benchmarks/bench_train.py --configs b8t1024 --steps 8 2>&1 | grep -A1 "ms/step" | tee "$out/bench_1gpu.log"
  timeout 200 python benchmarks/bench_train.py --configs b8t1024 --nproc 2 --steps 8 \
    --ab "${1:-graph._USE_NODE_PRIORITY=0;zero.SIDE_PRIORITY=0}" 2>&1 | grep -A1 "ms/step" | tee "$out/bench_2gpu.log"
fi
if [ "$stage" = "s7i" ]; then  # session 7, call I (2 GPUs): the review's zero.py edit; adam's bench rows
  python -c "from cukernels import _loader; _loader.precompile($TRAIN_FAMS)"
  timeout 200 python -m pytest -m gpu -q -p no:cacheprovider -n 4 tests/test_zero.py tests/test_train_distributed.py \
    tests/test_adam.py tests/test_distributed.py 2>&1 | tee "$out/gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR" | tail -n 12
  timeout 120 python benchmarks/bench_ops.py --no-startup --quick --only adam --json "$out/bench_ops.json" > "$out/bench_ops.log" 2>&1
  grep -E "^\||adam" "$out/bench_ops.log" | head -30
fi
if [ "$stage" = "s8a" ]; then  # session 8, call A: norm backwards: pipeline depth, block size, stats prefetch; tests + bench
  python -c "from cukernels import _loader; _loader.precompile(['rms_norm','layer_norm'])"
  timeout 300 python -m pytest -m gpu -q -p no:cacheprovider -n 8 tests/test_rms_norm.py tests/test_layer_norm.py \
    2>&1 | tee "$out/gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR|Error" | tail -n 40
  timeout 240 python benchmarks/tune_norm_backward.py 2>&1 | tee "$out/tune_norm_backward.log"
  timeout 100 python benchmarks/tune_norm_backward.py --timeline 2>&1 | grep "N=" | tee "$out/tune_timeline.log"
  timeout 150 python benchmarks/bench_ops.py --no-startup --quick --only rms_norm,layer_norm \
    --json "$out/bench_ops.json" > "$out/bench_ops.log" 2>&1
  grep -E "bwd|copy" "$out/bench_ops.log" | head -30
fi
if [ "$stage" = "s8b" ]; then  # session 8, call B: the norm backwards' kernel durations and gaps (CUPTI)
  python -c "from cukernels import _loader; _loader.precompile(['rms_norm','layer_norm'])"
  timeout 200 python benchmarks/tune_norm_backward.py --timeline ${1:-} 2>&1 | grep -v "Warning\|warn" | tee "$out/tune_timeline.log"
fi
if [ "$stage" = "s8c" ]; then  # session 8, call C: Nsight Compute counters of the norm backwards (and rms forward)
  python -c "from cukernels import _loader; _loader.precompile(['rms_norm','layer_norm'])"
  M=gpu__time_duration.sum,sm__cycles_active.avg,sm__cycles_elapsed.avg,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,dram__bytes_write.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,launch__registers_per_thread,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,smsp__inst_executed.sum
  for r in long_scoreboard barrier short_scoreboard lg_throttle mio_throttle drain membar wait math_pipe_throttle not_selected selected no_instruction branch_resolving dispatch_stall imc_miss misc sleeping tex_throttle; do
    M=$M,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio; done
  timeout ${NCU_TIMEOUT:-300} ncu --clock-control none -k regex:"${NCU_KERNELS:-bwdp|rms_fwd_bf16|finalize}" --csv --page raw --metrics $M \
    python benchmarks/ncu_norm_backward.py > "$out/ncu.csv" 2> "$out/ncu.err"; echo "ncu rc $?"; tail -3 "$out/ncu.err"
  python - "$out/ncu.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if r]
hdr = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
h, data = rows[hdr], [r for r in rows[hdr + 2:] if len(r) == len(rows[hdr])]
ki = h.index("Kernel Name")
for r in data:
    d = {h[i]: r[i] for i in range(len(h))}
    st = {k.split("stalled_")[1].split("_per")[0]: float(v) for k, v in d.items() if "stalled_" in k and v.replace('.', '', 1).isdigit()}
    top = ", ".join(f"{k} {v:.1f}" for k, v in sorted(st.items(), key=lambda t: -t[1])[:6])
    print(f"{d[h[ki]][:28]:28s} grid {d.get('launch__grid_size','?'):>5s} regs {d.get('launch__registers_per_thread','?'):>3s} "
          f"t {d.get('gpu__time_duration.sum','?'):>7s} active/elapsed {d.get('sm__cycles_active.avg','?')}/{d.get('sm__cycles_elapsed.avg','?')} "
          f"dram {d.get('dram__throughput.avg.pct_of_peak_sustained_elapsed','?')}% occ {d.get('sm__warps_active.avg.pct_of_peak_sustained_active','?')}% "
          f"rd {d.get('dram__bytes_read.sum','?')} wr {d.get('dram__bytes_write.sum','?')} | stalls/issue: {top}")
PY
fi
if [ "$stage" = "s8d" ]; then  # session 8, call D (final): the whole GPU suite, the norm rows, the LLaMA and GPT-2 steps
  python -c "import time; t=time.time(); from cukernels import _loader; _loader.precompile(); print(f'precompile {time.time()-t:.1f} s')"
  timeout 330 python -m pytest -m gpu -q -p no:cacheprovider -n 8 2>&1 | tee "$out/gpu_tests.log" \
    | grep -E "passed|failed|FAILED|ERROR" | tail -n 30
  timeout 120 python benchmarks/bench_ops.py --no-startup --quick --only rms_norm,layer_norm --json "$out/bench_ops.json" \
    > "$out/bench_ops.log" 2>&1; grep -E "bwd|fwd|copy" "$out/bench_ops.log" | head -30
  timeout 120 python benchmarks/bench_train.py --configs b8t1024,b4t64 --steps 10 --json "$out/bench_llama.json" 2>&1 \
    | grep -E "ms/step" | tee "$out/bench_llama.log"
  timeout 100 python benchmarks/bench_train.py --model gpt2 --steps 10 --json "$out/bench_gpt2.json" 2>&1 \
    | grep -E "ms/step" | tee "$out/bench_gpt2.log"
fi
if [ "$stage" = "s8e" ]; then  # session 8, call E: layer_norm forward with one Chan merge a row; its tests, rows, GPT-2
  python -c "from cukernels import _loader; _loader.precompile($TRAIN_FAMS)"
  timeout 150 python -m pytest -m gpu -q -p no:cacheprovider -n 8 tests/test_layer_norm.py tests/test_gpt2.py \
    tests/test_rms_norm.py 2>&1 | tee "$out/gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR" | tail -n 20
  timeout 100 python benchmarks/bench_ops.py --no-startup --quick --only layer_norm --json "$out/bench_ops.json" \
    > "$out/bench_ops.log" 2>&1; grep -E "layer_norm|copy" "$out/bench_ops.log" | head -12
  timeout 80 python benchmarks/bench_train.py --model gpt2 --steps 10 2>&1 | grep -E "ms/step" | tee "$out/bench_gpt2.log"
fi
if [ "$stage" = "s8f" ]; then  # session 8, call F: bf16 gradient buffers (AdamW grad_dtype): GPU tests, the 1B step A/B
  python -c "from cukernels import _loader; _loader.precompile($TRAIN_FAMS)"
  timeout 120 python -m pytest -m gpu -q -p no:cacheprovider -n 8 tests/test_optim.py tests/test_trainer.py \
    tests/test_graph.py tests/test_adam.py 2>&1 | tee "$out/gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR" | tail -n 20
  timeout 200 python benchmarks/bench_train.py --configs b4t64,b8t1024 --steps 10 --ab "__main__.GRAD_BF16=1" \
    --json "$out/bench_llama.json" 2>&1 | grep -E "ms/step|Error|error" | tee "$out/bench_llama.log"
fi
if [ "$stage" = "s9a" ]; then  # session 9, call A (2-GPU machine): the step benches, 1 GPU and 2 GPUs, A/B rows
  python -c "from cukernels import _loader; _loader.precompile($TRAIN_FAMS)"
  timeout 90 python -m pytest -m gpu -q -p no:cacheprovider -n 4 tests/test_embedding.py tests/test_linear_cross_entropy.py \
    -k "pack or bf16_grad" 2>&1 | tail -n 15 | tee "$out/new_tests.log"
  timeout 200 python benchmarks/bench_train.py --configs b8t1024,b4t64 --steps 10 --ab "__main__.GRAD_BF16=1" \
    --json "$out/bench_1gpu.json" > "$out/bench_1gpu.log" 2>&1; grep -E "ms/step|Error" "$out/bench_1gpu.log"
  timeout 330 python benchmarks/bench_train.py --configs b8t1024,b4t64 --steps 10 --nproc 2 \
    --ab "__main__.SPARSE_EXCHANGE=0;__main__.GRAD_BF16=1;__main__.GRAD_BF16=1,__main__.SPARSE_EXCHANGE=0" \
    --json "$out/bench_2gpu.json" > "$out/bench_2gpu.log" 2>&1
  grep -E "ms/step|Error|Traceback" "$out/bench_2gpu.log"; grep -B2 -A12 -m2 Traceback "$out/bench_2gpu.log" | head -60
fi
if [ "$stage" = "s9b" ]; then  # session 9, call B: the whole GPU suite (2-GPU tests included) + new kernel rows
  python -c "import time; t=time.time(); from cukernels import _loader; _loader.precompile(); print(f'precompile {time.time()-t:.1f} s')"
  timeout 420 python -m pytest -m gpu -q -p no:cacheprovider -n 8 2>&1 | tee "$out/gpu_tests.log" \
    | grep -E "passed|failed|FAILED|ERROR" | tail -n 40
fi
if [ "$stage" = "s9c" ]; then  # session 9, one GPU: the whole GPU suite (2-GPU tests skip), the 1-GPU step with bf16 grads A/B
  python -c "import time; t=time.time(); from cukernels import _loader; _loader.precompile(); print(f'precompile {time.time()-t:.1f} s')"
  timeout 360 python -m pytest -m gpu -q -p no:cacheprovider -n 8 2>&1 | tee "$out/gpu_tests.log" \
    | grep -E "passed|failed|FAILED|ERROR" | tail -n 40
  timeout 150 python benchmarks/bench_train.py --configs b8t1024,b4t64 --steps 10 --ab "__main__.GRAD_BF16=1" \
    --json "$out/bench_1gpu.json" > "$out/bench_1gpu.log" 2>&1; grep -E "ms/step|Error" "$out/bench_1gpu.log"
fi
if [ "$stage" = "s10a" ]; then  # session 10, call A (one GPU): the sparse-exchange kernels after the review refactor,
  # their bench rows, and where the sm_90 attention kernels' time goes (sweep fit + Nsight Compute sections)
  python -c "import time; t=time.time(); from cukernels import _loader; _loader.precompile(['embedding','attention_sm90','attention']); print(f'precompile {time.time()-t:.1f} s')"
  timeout 120 python -m pytest -m gpu -q -p no:cacheprovider -n 8 tests/test_embedding.py tests/test_zero.py 2>&1 \
    | tee "$out/gpu_tests_emb.log" | grep -E "passed|failed|FAILED|ERROR" | tail -n 20
  timeout 100 python benchmarks/bench_ops.py --no-startup --quick --only embedding --json "$out/bench_emb.json" \
    > "$out/bench_emb.log" 2>&1; grep -E "^embedding|Error" "$out/bench_emb.log"
  timeout 150 python benchmarks/attention_sweep.py 2>&1 | tee "$out/attention_sweep.log"
  ncu --query-metrics --chip gh100 2>/dev/null | grep -iE "gmma|pipe_tensor" | head -20 > "$out/ncu_metrics.txt"
  cat > /tmp/ncu_attn.py <<'PY'
import cupy as cp, cukernels as ck
r = lambda *s: cp.random.standard_normal(s, dtype=cp.float32).astype(ck.bfloat16)
for B, T in ((8, 1024), (2, 4096)):
    q, k, v, do = r(B, T, 32, 64), r(B, T, 8, 64), r(B, T, 8, 64), r(B, T, 32, 64)
    for _ in range(2):
        o, lse = ck.flash_attention_sm90(q, k, v, causal=True, return_lse=True)
        ck.flash_attention_backward_sm90(do, q, k, v, o, lse, causal=True)
    cp.cuda.Device().synchronize()
PY
  timeout 200 ncu --clock-control none -k regex:attn_sm90 --section SpeedOfLight --section Occupancy \
    --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    python /tmp/ncu_attn.py > "$out/ncu_attn.txt" 2> "$out/ncu_attn.err"; echo "ncu rc $?"
  grep -E "attn_sm90|Duration|SM Busy|Compute \(SM\)|Memory Throughput|Achieved Occupancy|Issue Slots|Executed Ipc A|Stall|L2 Hit|DRAM Throughput" "$out/ncu_attn.txt" | head -150
fi
if [ "$stage" = "s10b" ]; then  # session 10, call B: the persistent attention kernels (tests first, a hang shows)
  python -c "import time; t=time.time(); from cukernels import _loader; _loader.precompile(['attention_sm90','attention','embedding']); print(f'precompile {time.time()-t:.1f} s')"
  timeout 90 python -m pytest -m gpu -q -p no:cacheprovider -x --tb=short tests/test_attention_sm90.py -k smoke 2>&1 \
    | tee "$out/sm90_smoke.log" | tail -n 8
  timeout 240 python -m pytest -m gpu -q -p no:cacheprovider -n 8 --tb=short tests/test_attention_sm90.py \
    tests/test_attention.py 2>&1 | tee "$out/gpu_tests_attn.log" | grep -E "passed|failed|FAILED|ERROR|Error" | tail -n 30
  timeout 200 python benchmarks/attention_sweep.py 2>&1 | tee "$out/attention_sweep.log"
  timeout 100 python benchmarks/bench_ops.py --no-startup --quick --only attention_sm90,embedding \
    --json "$out/bench_ops.json" > "$out/bench_ops.log" 2>&1; grep -E "^(flash|embedding)|Error" "$out/bench_ops.log"
fi
if [ "$stage" = "s10c" ]; then  # session 10, call C: no-zeroing + two max chains; the forward on ncu's full set
  python -c "from cukernels import _loader; _loader.precompile(['attention_sm90','attention'])"
  timeout 60 python -m pytest -m gpu -q -p no:cacheprovider -x --tb=short tests/test_attention_sm90.py -k smoke 2>&1 | tail -n 3
  timeout 200 python -m pytest -m gpu -q -p no:cacheprovider -n 8 --tb=short tests/test_attention_sm90.py 2>&1 \
    | tee "$out/gpu_tests_attn.log" | grep -E "passed|failed|FAILED|ERROR|Error" | tail -n 30
  timeout 150 python benchmarks/attention_sweep.py 2>&1 | tee "$out/attention_sweep.log" | grep -E "persist|^ *T "
  cat > /tmp/ncu_fwd.py <<'PY'
import cupy as cp, cukernels as ck
r = lambda *s: cp.random.standard_normal(s, dtype=cp.float32).astype(ck.bfloat16)
q, k, v, do = r(8, 1024, 32, 64), r(8, 1024, 8, 64), r(8, 1024, 8, 64), r(8, 1024, 32, 64)
for _ in range(2):
    o, lse = ck.flash_attention_sm90(q, k, v, causal=True, return_lse=True)
    ck.flash_attention_backward_sm90(do, q, k, v, o, lse, causal=True)
cp.cuda.Device().synchronize()
PY
  timeout 240 ncu --set full --import-source no -k regex:attn_sm90 --launch-skip 3 --launch-count 3 -o /tmp/attn \
    python /tmp/ncu_fwd.py > "$out/ncu_full.out" 2>&1; echo "ncu rc $?"; tail -n 3 "$out/ncu_full.out"
  ncu -i /tmp/attn.ncu-rep --page raw --csv > "$out/ncu_raw.csv" 2>&1
  ncu -i /tmp/attn.ncu-rep --page details --print-details all > "$out/ncu_details.txt" 2>&1
  ncu -i /tmp/attn.ncu-rep --page source --csv --print-source sass --kernel-name regex:fwd > "$out/ncu_fwd_sass.csv" 2>&1
  python - "$out/ncu_raw.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if r]
hdr = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
h = rows[hdr]
for r in rows[hdr + 2:]:
    if len(r) != len(h):
        continue
    d = dict(zip(h, r))
    print("==", d["Kernel Name"][:32], d.get("gpu__time_duration.sum"))
    keys = [k for k in h if any(s in k for s in ("pipe_tensor", "pipe_xu", "pipe_fma", "pipe_alu", "inst_executed_pipe", "warps_issue_stalled")) and ("pct" in k or "ratio" in k or k.endswith(".sum"))]
    for k in keys:
        v = d[k]
        try:
            if float(v.replace(",", "")) == 0:
                continue
        except ValueError:
            continue
        print(f"   {k} {v}")
PY
fi
if [ "$stage" = "s10d" ]; then  # session 10, call D: 2 fixed-tile buffers + deeper rings; tests, sweep, rows, the step
  python -c "from cukernels import _loader; _loader.precompile(['attention_sm90','attention'])"
  timeout 60 python -m pytest -m gpu -q -p no:cacheprovider -x --tb=short tests/test_attention_sm90.py -k smoke 2>&1 | tail -n 3
  timeout 200 python -m pytest -m gpu -q -p no:cacheprovider -n 8 --tb=short tests/test_attention_sm90.py \
    tests/test_attention.py 2>&1 | tee "$out/gpu_tests_attn.log" | grep -E "passed|failed|FAILED|ERROR|Error" | tail -n 30
  timeout 150 python benchmarks/attention_sweep.py 2>&1 | tee "$out/attention_sweep.log" | grep -E "persist|^ *T "
  timeout 100 python benchmarks/bench_ops.py --no-startup --quick --only attention_sm90 \
    --json "$out/bench_ops.json" > "$out/bench_ops.log" 2>&1; grep -E "^flash|Error" "$out/bench_ops.log"
fi
if [ "$stage" = "s10e" ]; then  # session 10, call E (final): the whole GPU suite, the attention variants, the step
  python -c "import time; t=time.time(); from cukernels import _loader; _loader.precompile(); print(f'precompile {time.time()-t:.1f} s')"
  timeout 330 python -m pytest -m gpu -q -p no:cacheprovider -n 8 2>&1 | tee "$out/gpu_tests.log" \
    | grep -E "passed|failed|FAILED|ERROR" | tail -n 40
  timeout 100 python benchmarks/attention_sweep.py 2>&1 | tee "$out/attention_sweep.log" | grep -E "persist|fwd |^ *T "
  timeout 70 python benchmarks/bench_ops.py --no-startup --quick --only attention_sm90 \
    --json "$out/bench_ops.json" > "$out/bench_ops.log" 2>&1; grep -E "^flash|Error" "$out/bench_ops.log"
  timeout 130 python benchmarks/bench_train.py --configs b8t1024 --steps 10 --ab "attention_sm90.VARIANT=_wg3" \
    --json "$out/bench_llama.json" > "$out/bench_llama.log" 2>&1; grep -E "ms/step|Error" "$out/bench_llama.log" | head -20
fi
if [ "$stage" = "s10f" ]; then  # session 10, call F: VARIANT = "auto" (Python dispatch over run E's tested kernels)
  python -c "import time; t=time.time(); from cukernels import _loader; _loader.precompile($TRAIN_FAMS); print(f'precompile {time.time()-t:.1f} s')"
  timeout 150 python -m pytest -m gpu -q -p no:cacheprovider -n 8 tests/test_attention_sm90.py tests/test_attention.py \
    tests/test_models.py tests/test_gpt2.py tests/test_nn.py tests/test_trainer.py 2>&1 | tee "$out/gpu_tests.log" \
    | grep -E "passed|failed|FAILED|ERROR" | tail -n 30
  timeout 110 python benchmarks/attention_sweep.py 2>&1 | tee "$out/attention_sweep.log" | grep -E "persist|fwd |^ *T "
  timeout 45 python benchmarks/attention_sweep.py --dim 128 --heads 16/16 --seqs 1024,4096 2>&1 \
    | tee "$out/attention_sweep_d128.log" | grep -E "persist|fwd |^ *T "
  timeout 100 python benchmarks/bench_train.py --configs b8t1024 --steps 10 --json "$out/bench_llama.json" \
    > "$out/bench_llama.log" 2>&1; grep -E "ms/step|Error" "$out/bench_llama.log" | head -5
fi
if [ "$stage" = "s10g" ]; then  # session 10, call G: the final auto policy (wg3 for long loops, serial at D128)
  python -c "from cukernels import _loader; _loader.precompile(['attention_sm90','attention'])"
  timeout 100 python -m pytest -m gpu -q -p no:cacheprovider -n 8 tests/test_attention_sm90.py -k "auto or smoke or persistent" \
    2>&1 | tee "$out/gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR" | tail -n 20
fi
if [ "$stage" = "s11a" ]; then  # session 11, call A: the switched auto policy's tests; where B4xT64's 15.5 ms go
  python -c "from cukernels import _loader; _loader.precompile(['attention_sm90','attention'])"
  timeout 100 python -m pytest -m gpu -q -p no:cacheprovider -n 8 tests/test_attention_sm90.py -k "auto or smoke or persistent" \
    2>&1 | tee "$out/gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR" | tail -n 20
  timeout 200 python benchmarks/bench_train.py --configs b4t64 --ab "__main__.GRAD_BF16=1" --timeline "$out/tl" \
    --json "$out/bench_llama.json" 2>&1 | tee "$out/bench_llama.log" | grep -v "^    "
fi
if [ "$stage" = "s11b" ]; then  # session 11, call B: packed q/k/v and gate/up (PackedLinear), token-strided rope
  python -c "from cukernels import _loader; _loader.precompile(['adam','attention','attention_sm90','cross_entropy','elementwise','embedding','rms_norm','rope','activations','layer_norm','dropout'])"
  timeout 300 python -m pytest -m gpu -q -p no:cacheprovider -n 8 tests/test_rope.py tests/test_nn.py tests/test_models.py \
    tests/test_gpt2.py tests/test_trainer.py tests/test_optim.py tests/test_attention.py tests/test_linear_cross_entropy.py \
    tests/test_autograd.py tests/test_hf.py tests/test_zero.py tests/test_resume.py tests/test_checkpoint.py \
    2>&1 | tee "$out/gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR" | tail -n 30
  timeout 260 python benchmarks/bench_train.py --configs b4t64,b8t1024 --timeline "$out/tl" \
    --ab "__main__.GRAD_BF16=1;__main__.GRAD_BF16=1,layers.PACK_PROJECTIONS=0;layers.PACK_PROJECTIONS=0" \
    --json "$out/bench_llama.json" 2>&1 | tee "$out/bench_llama.log" | grep -v "^    "
fi
if [ "$stage" = "s11c" ]; then  # session 11, call C: dqkv stored in place, softmax clusters, cuBLAS workspace A/B
  python -c "from cukernels import _loader; _loader.precompile(['softmax','adam','attention','attention_sm90','cross_entropy','elementwise','embedding','rms_norm','rope','activations'])"
  timeout 240 python -m pytest -m gpu -q -p no:cacheprovider -n 8 tests/test_softmax.py tests/test_rope.py tests/test_nn.py \
    tests/test_gpt2.py tests/test_models.py tests/test_attention.py tests/test_attention_sm90.py -k "not test_gpu_sweep" \
    2>&1 | tee "$out/gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR" | tail -n 30
  timeout 150 python benchmarks/bench_ops.py --no-startup --only softmax --json "$out/bench_softmax.json" > "$out/bench_softmax.log" 2>&1
  grep -E "65536|131072|32768|A/B" "$out/bench_softmax.log" | head -40
  timeout 200 python benchmarks/bench_train.py --configs b4t64,b8t1024 --ab "__main__.GRAD_BF16=1" --timeline "$out/tl" \
    --json "$out/bench_llama.json" 2>&1 | tee "$out/bench_llama.log" | grep -v "^    "
  timeout 120 python -c "import sys, runpy; sys.path.insert(0, 'benchmarks'); import cukernels.blas as b; b.WORKSPACE_BYTES = 0; sys.argv = ['bench_train.py', '--configs', 'b4t64,b8t1024', '--ab', '__main__.GRAD_BF16=1']; runpy.run_path('benchmarks/bench_train.py', run_name='__main__')" \
    2>&1 | tee "$out/bench_llama_ws0.log" | grep -v "^    " | grep "cukernels"
fi
if [ "$stage" = "s11d" ]; then  # session 11, call D: the whole GPU suite on the session's tree
  python -c "import time; t=time.time(); from cukernels import _loader; _loader.precompile(); print(f'precompile {time.time()-t:.1f} s')"
  timeout 450 python -m pytest -m gpu -q -p no:cacheprovider -n 8 --tb=line 2>&1 | tee "$out/gpu_tests.log" \
    | grep -E "passed|failed|FAILED|ERROR" | tail -n 40
fi
if [ "$stage" = "s11e" ]; then  # session 11, call E: bench_ops rows of the issue-17 misses + the steps (LLaMA, GPT-2)
  timeout 240 python benchmarks/bench_ops.py --no-startup --quick \
    --only rms_norm,layer_norm,softmax,attention_sm90,rope,activations,embedding,linear_cross_entropy \
    --json "$out/bench_ops.json" > "$out/bench_ops.log" 2>&1; grep -v "A/B" "$out/bench_ops.log" | tail -n 70
  timeout 150 python benchmarks/bench_train.py --configs b4t64,b8t1024 --ab "__main__.GRAD_BF16=1" \
    --json "$out/bench_llama.json" 2>&1 | tee "$out/bench_llama.log" | grep -v "^    "
  timeout 120 python benchmarks/bench_train.py --model gpt2 --json "$out/bench_gpt2.json" 2>&1 | tee "$out/bench_gpt2.log" \
    | grep -v "^    "
fi
if [ "$stage" = "s11f" ]; then  # session 11, call F: rope backward fused into the sm_90 attention backward
  python -c "from cukernels import _loader; _loader.precompile(['attention_sm90','attention','rope','adam','cross_entropy','elementwise','embedding','rms_norm','activations'])"
  timeout 240 python -m pytest -m gpu -q -p no:cacheprovider -n 8 tests/test_attention.py tests/test_attention_sm90.py \
    tests/test_nn.py tests/test_gpt2.py tests/test_models.py tests/test_trainer.py tests/test_rope.py \
    2>&1 | tee "$out/gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR" | tail -n 30
  timeout 200 python benchmarks/bench_train.py --configs b4t64,b8t1024 \
    --ab "__main__.GRAD_BF16=1;__main__.GRAD_BF16=1,functional.kernel_ops.ROPE_IN_ATTENTION_BACKWARD=0;functional.kernel_ops.ROPE_IN_ATTENTION_BACKWARD=0" \
    --json "$out/bench_llama.json" 2>&1 | tee "$out/bench_llama.log" | grep -v "^    "
fi
if [ "$stage" = "s11g" ]; then  # session 11, call G: stale-gradient overwrites through ck.cast (the head's fp32 dW)
  python -c "from cukernels import _loader; _loader.precompile(['attention_sm90','attention','rope','adam','cross_entropy','elementwise','embedding','rms_norm','activations'])"
  timeout 150 python -m pytest -m gpu -q -p no:cacheprovider -n 8 tests/test_autograd.py tests/test_linear_cross_entropy.py \
    tests/test_models.py tests/test_trainer.py tests/test_optim.py 2>&1 | tee "$out/gpu_tests.log" \
    | grep -E "passed|failed|FAILED|ERROR" | tail -n 20
  timeout 150 python benchmarks/bench_train.py --configs b8t1024 \
    --ab "__main__.GRAD_BF16=1;__main__.GRAD_BF16=1,autograd.FAST_CAST=0" \
    --json "$out/bench_llama.json" 2>&1 | tee "$out/bench_llama.log" | grep -v "^    "
fi
