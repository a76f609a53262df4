# Run E (session 15): the head budget and the CE cache hints in the B8xT1024 step, rows interleaved (A B A B) in
# one process against the thermal drift of a power-capped GPU; 20 timed steps a row.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/ckc
H1="functional.loss_ops.HEAD_WORKSPACE=1073741824"; H0="functional.loss_ops.HEAD_WORKSPACE=536870912"
C1="cross_entropy.CACHE_HINTS=1"; C0="cross_entropy.CACHE_HINTS=0"
AB="$H0;$C0;$H1;$H0;$C0;$C1;$H1"
timeout 250 python benchmarks/bench_train.py --configs b8t1024 --steps 20 --ab "$AB" 2>&1 | tee $OUT/runE_fp32.log | grep -E "cukernels"
BF="__main__.GRAD_BF16=1"
timeout 250 python benchmarks/bench_train.py --configs b8t1024 --steps 20 --ab "$BF;$BF,$H0;$BF,$H1;$BF,$H0;$BF,$H1" 2>&1 | tee $OUT/runE_bf16.log | grep -E "cukernels"
