# Run D: Nsight Compute counters of both backward kernels (BWD_KERNEL warp / pipe) at 256, 1024, 8192 x 2048 bf16
# (benchmarks/ncu_norm_backward.py as of commit 5258e3c, which set both modules' BWD_KERNEL); output runD_ncu.csv.
NCU_KERNELS="bwdw|bwdp|finalize" NCU_TIMEOUT=360 bash benchmarks/run_session.sh s8c
