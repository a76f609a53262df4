"""Question: where does the fused (five-product) sm_90 backward's time go? Times each kernel of the fused backward
(delta, dkdvq, convert) and of the two-kernel one (dq, dkdv) alone, with CUDA events over repeated launches, at the
issue-17 shapes (B8xT1024 and B2xT4096, H32/8, D64, causal).

Answer (2026-12-01, one H200, ``python dev/fused_dq_probe.py``): at B8xT1024 delta 20 us, dkdvq ~275 us, convert
24 us (the whole fused backward 0.329 ms against the two-kernel 0.375). An earlier version, with dkdvq's parts
compiled out one at a time, placed its cost: the fifth product +6 us, the warpgroup hand-off +32, the
``red.global.add`` adds +64, the semaphore turn +105, which is why the adds moved to writer warps with one bulk
reduce-add a hand-off (benchmarks/NOTES.md, "flash_attention_sm90").

    PYTHONPATH=. python dev/fused_dq_probe.py
"""
import cupy as cp
import numpy as np

import cukernels as ck
from cukernels.ops import attention_sm90 as A90
from cukernels._loader import get_function


def timed(fn, reps=20):
    fn()
    s, e = cp.cuda.Event(), cp.cuda.Event()
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    e.synchronize()
    return cp.cuda.get_elapsed_time(s, e) / reps * 1e3  # us


def main():
    for Bsz, T, H, Hkv in ((8, 1024, 32, 8), (2, 4096, 32, 8)):
        D = 64
        r = lambda *s: cp.random.standard_normal(s, dtype=cp.float32).astype(ck.bfloat16)  # noqa: E731
        q, k, v, do = r(Bsz, T, H, D), r(Bsz, T, Hkv, D), r(Bsz, T, Hkv, D), r(Bsz, T, H, D)
        o, lse = A90.flash_attention_sm90(q, k, v, causal=True, return_lse=True)
        dq, dk, dv = (cp.empty_like(x) for x in (q, k, v))
        delta = cp.empty((Bsz, H, T), np.float32)
        nqb = -(-T // 64)
        sem = cp.zeros((Bsz, H, nqb), np.int32)
        acc = cp.empty((Bsz, H, nqb * 64, D), np.float32)
        sq, sk, sv, sd = (A90._strides(n, x) for n, x in (("q", q), ("k", k), ("v", v), ("dout", do)))
        tail = (np.int32(T), np.int32(T), np.int32(H), np.int32(Hkv), np.float32(D ** -0.5), np.bool_(True),
                np.int32(Bsz))
        rt = A90._rope_args(None, Bsz, T, T, D)
        rows = Bsz * T * H
        fdel = get_function(A90.FAMILY, "attn_sm90_bwd_delta_d64")
        fcv = get_function(A90.FAMILY, "attn_sm90_bwd_dq_convert_d64")
        kq, smq = A90._kernel(D, "", "dq")
        kd, smd = A90._kernel(D, "", "dkdv")
        kf, smf = A90._kernel(D, "", "dkdvq")
        nt = -(-T // 128) * Hkv * Bsz
        g = A90.grid(nt)
        row = lambda name, us: print(f"  {name:34s} {us:9.1f} us", flush=True)  # noqa: E731
        print(f"B{Bsz}xT{T} H{H}/{Hkv} D64 causal (grid {g})")
        row("delta", timed(lambda: fdel((-(-rows * 8 // 256),), (256,), (o, do, delta, *sd, np.int32(T), np.int32(H),
                                                                            np.int32(Bsz)))))
        row("convert", timed(lambda: fcv((-(-rows * 8 // 256),), (256,), (acc, sem, dq, *A90._strides("dq", dq),
                                                                         np.int32(T), np.int32(H), np.int32(Bsz),
                                                                         np.float32(0.125), *rt))))
        row("dq (two-kernel)", timed(lambda: kq((A90.grid(nqb // 2 * H * Bsz),), (384,), (
            q, k, v, o, do, lse, delta, dq, *sq, *sk, *sv, *sd, *tail, *A90._strides("dq", dq), *rt),
            shared_mem=smq)))
        row("dkdv (two-kernel)", timed(lambda: kd((g,), (384,), (
            q, k, v, do, lse, delta, dk, dv, *sq, *sk, *sv, *sd, *tail, *A90._strides("dk", dk), *rt),
            shared_mem=smd)))
        row("dkdvq (+ sem memset)", timed(lambda: (sem.fill(0), kf((g,), (384,), (
            q, k, v, do, lse, delta, dk, dv, *sq, *sk, *sv, *sd, *tail, *A90._strides("dk", dk), *rt, acc, sem),
            shared_mem=smf))))
        row("sem memset alone", timed(lambda: sem.fill(0)))
        for mode in ("fused", "kernel"):
            with ck.settings(attention_sm90_bwd_dq=mode):
                row(f"whole backward, {mode}", timed(lambda: A90.flash_attention_backward_sm90(do, q, k, v, o, lse)))


if __name__ == "__main__":
    main()
