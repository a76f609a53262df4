"""Calls for Nsight Compute: rms_norm / layer_norm backward and the rms_norm forward at 1024 and 8192 rows of
2048 (bf16), each 3 times, so `ncu -k regex:... --launch-skip` can read one warm launch of each. GPU only.

    ncu --clock-control none -k regex:"bwdp|fwd_bf16|finalize" --csv --page raw --metrics ... \\
        python benchmarks/ncu_norm_backward.py
"""
import cupy as cp

import cukernels as ck

for N in (1024, 8192):
    x = cp.random.standard_normal((N, 2048), dtype=cp.float32).astype(ck.bfloat16)
    dy = cp.random.standard_normal((N, 2048), dtype=cp.float32).astype(ck.bfloat16)
    w = cp.random.standard_normal(2048, dtype=cp.float32)
    b = cp.random.standard_normal(2048, dtype=cp.float32)
    _, r = ck.rms_norm(x, w, return_rstd=True)
    _, m, s = ck.layer_norm(x, w, b, return_stats=True)
    out = cp.empty_like(x)
    for _ in range(3):
        ck.rms_norm_backward(dy, x, w, r, out=out)
    for _ in range(3):
        ck.layer_norm_backward(dy, x, w, m, s, out=out)
    for _ in range(3):
        ck.rms_norm(x, w, out=out)
    cp.cuda.Device().synchronize()
