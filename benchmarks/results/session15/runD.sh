# Run D (session 15, final code): the step benchmarks, same process A/B against the op's own 512 MiB head budget
# (the policy before this session), nvidia-smi sampling clocks and power throughout.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/ckc
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv,noheader -lms 100 > $OUT/runD_smi.csv &
SMI=$!
AB="functional.loss_ops.HEAD_WORKSPACE=536870912"
timeout 300 python benchmarks/bench_train.py --configs b8t1024,b4t64 --ab "$AB;__main__.GRAD_BF16=1;__main__.GRAD_BF16=1,$AB" 2>&1 | tee $OUT/runD_bench_llama.log | grep -E "cukernels|peak"
timeout 150 python benchmarks/bench_train.py --model gpt2 --steps 10 --ab "$AB" 2>&1 | tee $OUT/runD_bench_gpt2.log | grep -E "cukernels|ms/step|peak"
kill $SMI
