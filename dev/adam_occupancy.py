"""Question: does the dense AdamW update at the LLaMA-3.2-1B size (1.236e9 elements: fp32 param / moments, bf16 or
fp32 gradient, bf16 shadow) stream closer to copy speed with a deeper grid than one persistent wave (ck.adam_step's
``occupancy``: waves of 256-thread blocks)? The copy ceiling is timed in the same process.

Answer (2026-12-01, one H200, ``python dev/adam_occupancy.py``): no. Copy 4.24 TB/s; bf16 gradient 8.80-8.98 ms
(90.8-92.6 % of copy) and fp32 gradient 9.30-9.51 ms (91.8-94.0 %) over occupancy 0.5 / 1 / 2 / 4 / 8 / 16, no trend
beyond +-1 %. The update's 8 streams sit at 92-94 % of a 1:1 copy whatever the grid, so adam_step keeps one wave
(benchmarks/NOTES.md, "adam").

    PYTHONPATH=. python dev/adam_occupancy.py [--n 1236000000] [--occ 1,2,4,8,0.5]
"""
from __future__ import annotations

import argparse

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1_236_000_000)
    ap.add_argument("--occ", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    import cupy as cp

    import cukernels as ck

    n = a.n
    p = cp.zeros(n, cp.float32)
    m, v = cp.zeros(n, cp.float32), cp.zeros(n, cp.float32)
    sh = cp.zeros(n, ck.bfloat16)
    lr, step = cp.full((), 1e-4, cp.float32), cp.ones((), cp.int32)
    scale = cp.ones((), cp.float32)

    def timed(fn):
        fn()
        s, e = cp.cuda.Event(), cp.cuda.Event()
        s.record()
        for _ in range(a.reps):
            fn()
        e.record()
        e.synchronize()
        return cp.cuda.get_elapsed_time(s, e) / a.reps

    src, dst = cp.zeros(n * 4 // 4, cp.float32), cp.zeros(n, cp.float32)
    t = timed(lambda: dst.__setitem__(Ellipsis, src))
    copy_bw = 2 * 4 * n / t / 1e6  # t in ms: GB/s
    print(f"copy {n * 4 / 1e9:.1f} GB: {t:.3f} ms, {copy_bw:.0f} GB/s (read + write)")
    del src, dst
    for gdt, gb in ((ck.bfloat16, 2), (np.float32, 4)):
        g = cp.zeros(n, gdt)
        byts = n * (24 + gb + 2)
        for occ in [float(x) for x in a.occ.split(",")]:
            t = timed(lambda: ck.adam_step(p, g, m, v, lr=lr, step=step, weight_decay=0.1, shadow=sh,
                                           grad_scale=scale, occupancy=occ))
            print(f"adam grad {np.dtype(gdt).name:8s} occupancy {occ:5.2f}: {t:7.3f} ms  {byts / t / 1e6:6.0f} GB/s  "
                  f"{byts / t / 1e6 / copy_bw:5.1%} of copy")
        del g


if __name__ == "__main__":
    main()
