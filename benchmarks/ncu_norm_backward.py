"""Calls for Nsight Compute: rms_norm / layer_norm backward (each backward kernel: BWD_KERNEL "warp" and "pipe")
and the rms_norm forward at 256, 1024 and 8192 rows of 2048 (bf16), each twice, so `ncu -k regex:...
--launch-skip` can read one warm launch of each. GPU only.

    ncu --clock-control none -k regex:"bwdw|bwdp|fwd_bf16|finalize" --csv --page raw --metrics ... \\
        python benchmarks/ncu_norm_backward.py
"""
import cupy as cp

import cukernels as ck
from cukernels.ops import layer_norm as LN
from cukernels.ops import rms_norm as R

for N, kernel in ((n, k) for n in (256, 1024, 8192) for k in ("warp", "pipe")):
    R.BWD_KERNEL = LN.BWD_KERNEL = kernel
    x = cp.random.standard_normal((N, 2048), dtype=cp.float32).astype(ck.bfloat16)
    dy = cp.random.standard_normal((N, 2048), dtype=cp.float32).astype(ck.bfloat16)
    w = cp.random.standard_normal(2048, dtype=cp.float32)
    b = cp.random.standard_normal(2048, dtype=cp.float32)
    _, r = ck.rms_norm(x, w, return_rstd=True)
    _, m, s = ck.layer_norm(x, w, b, return_stats=True)
    out = cp.empty_like(x)
    for _ in range(2):
        ck.rms_norm_backward(dy, x, w, r, out=out)
    for _ in range(2):
        ck.layer_norm_backward(dy, x, w, m, s, out=out)
    for _ in range(2):
        ck.rms_norm(x, w, out=out)
    cp.cuda.Device().synchronize()
