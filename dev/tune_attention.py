"""Question: which tile width, fragment placement (registers or re-read from shared memory) and resident blocks per SM
should the mma.sync attention kernels (kernels_cu/attention.cu) use? Times the experimental instantiations against
the production ones on the training shapes.

Answer (2026-11-29, one H200, ``python dev/tune_attention.py`` with 11 variants instantiated): fwd 64-key tiles at 3
blocks/SM (205.7 us at B8xT1024 causal, 2 blocks/SM 217.5), dq 32-key tiles with fragments in registers at 3
blocks/SM (261.9 us, 64-key 282.3), dkdv 64-query tiles with K/V fragments in registers at 2 blocks/SM (379.9 us);
the production kernels are those (benchmarks/NOTES.md, "flash_attention", the tuning table). The *_km (key-mask)
variants run with an all-ones mask (the mask machinery alone) and with 25 % left padding.

Each variant is launched with the production launcher's arguments and checked against the production
kernel's output (max |difference|; the variants only reorder fp32 work). Key-masked variants (``*_km*``) run
twice: with a mask of all ones (the cost of the mask machinery alone; output bit-identical to the unmasked
kernel) and with the benchmark's 25 % left-padding mask (checked against ck.flash_attention with that mask).

    PYTHONPATH=. python dev/tune_attention.py
"""
import os
import statistics
import sys

import cupy as cp
import numpy as np

sys.path.insert(0, ".")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))  # cases
import cukernels as ck  # noqa: E402
from cukernels._loader import get_function  # noqa: E402
from cukernels.ops import attention as A  # noqa: E402
from cases.attention import left_padding_mask  # noqa: E402

D = 64
# name -> (kind, tile): tile = key tile (fwd, dq) or query tile (dkdv); same shared layouts as production. To try
# a variant, instantiate it at the end of attention.cu (e.g. ``CK_ATTN_DQ(64, 64, false, 2, _x1)`` defines
# attn_bwd_dq_d64_x1 and its key-masked twin attn_bwd_dq_d64_km_x1) and list it here. Session 2 compared 11
# variants this way (benchmarks/NOTES.md, "flash_attention").
VARIANTS = {"attn_fwd_d64": ("fwd", A.TILES[D][0]), "attn_bwd_dq_d64": ("dq", A.TILES[D][1]),
            "attn_bwd_dkdv_d64": ("dkdv", A.TILES[D][2]),
            "attn_fwd_d64_km": ("fwd", A.TILES[D][0]), "attn_bwd_dq_d64_km": ("dq", A.TILES[D][1]),
            "attn_bwd_dkdv_d64_km": ("dkdv", A.TILES[D][2])}


def smem(kind, t):
    row = (D + 8) * 2
    if kind == "fwd":
        return (A.BM + 4 * t) * row
    if kind == "dq":
        return (2 * A.BM + 4 * t) * row + A.BM * 4
    return (2 * A.BM + 4 * t) * row + 4 * t * 4


def timed(fn, reps=20):
    fn()
    cp.cuda.Device().synchronize()
    ts = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b) * 1e3)
    return statistics.median(ts)


def main():
    for Bsz, T, H, Hkv, causal in ((8, 1024, 32, 8, True), (2, 4096, 32, 8, True), (4, 64, 32, 8, True)):
        r = lambda *s: cp.random.standard_normal(s, dtype=cp.float32).astype(ck.bfloat16)  # noqa: E731
        q, k, v, do = r(Bsz, T, H, D), r(Bsz, T, Hkv, D), r(Bsz, T, Hkv, D), r(Bsz, T, H, D)
        o, lse = ck.flash_attention(q, k, v, causal=causal, return_lse=True)
        dq0, dk0, dv0 = ck.flash_attention_backward(do, q, k, v, o, lse, causal=causal)
        pad = left_padding_mask(cp, Bsz, T)
        om, lsem = ck.flash_attention(q, k, v, causal=causal, key_mask=pad, return_lse=True)
        dqm, dkm, _ = ck.flash_attention_backward(do, q, k, v, om, lsem, causal=causal, key_mask=pad)
        masks = {"ones": cp.ones((Bsz, T), cp.int64), "pad25%L": pad}
        delta = cp.empty((Bsz, H, T), cp.float32)
        st = (*A._strides("q", q), *A._strides("k", k), *A._strides("v", v))
        sd = A._strides("dout", do)
        tail = (np.int32(T), np.int32(T), np.int32(H), np.int32(Hkv), np.float32(1 / 8), np.bool_(causal))
        # delta for the dkdv variants: production dq
        kq = get_function("attention", "attn_bwd_dq_d64")
        dqx = cp.empty_like(q)
        kq((-(-T // A.BM), H, Bsz), (A.THREADS, 1, 1), (q, k, v, o, do, lse, delta, dqx, *st, *sd, *tail),
           shared_mem=smem("dq", A.TILES[D][1]))
        f = 4.0 * Bsz * H * T * T * D * (0.5 if causal else 1.0)
        print(f"== B{Bsz} T{T} H{H}/{Hkv} D{D} causal={causal}")
        # delta of the padded batch for the masked dkdv variants (the mask changes o, hence delta)
        deltam = cp.empty_like(delta)
        get_function("attention", "attn_bwd_dq_d64_km")(
            (-(-T // A.BM), H, Bsz), (A.THREADS, 1, 1),
            (q, k, v, om, do, lsem, deltam, cp.empty_like(q), *st, *sd, *tail, pad, np.int64(T), np.int32(8)),
            shared_mem=smem("dq", A.TILES[D][1]))
        for name, (kind, t) in VARIANTS.items():
            for mname in (("ones", "pad25%L") if "_km" in name else (None,)):
                kern = get_function("attention", name)
                sm = smem(kind, t)
                kern.max_dynamic_shared_size_bytes = sm
                padded = mname == "pad25%L"
                o_, lse_, delta_ = (om, lsem, deltam) if padded else (o, lse, delta)
                extra = () if mname is None else (masks[mname], np.int64(T), np.int32(8))
                if kind == "fwd":
                    oo, ll = cp.empty_like(o), cp.empty_like(lse)
                    args = (q, k, v, oo, ll, *st, *tail, *extra)
                    grid, ref, got = (-(-T // A.BM), H, Bsz), om if padded else o, oo
                elif kind == "dq":
                    dd, dl = cp.empty_like(q), cp.empty_like(delta)
                    args = (q, k, v, o_, do, lse_, dl, dd, *st, *sd, *tail, *extra)
                    grid, ref, got = (-(-T // A.BM), H, Bsz), dqm if padded else dq0, dd
                else:
                    dk, dv = cp.empty_like(k), cp.empty_like(v)
                    args = (q, k, v, do, lse_, delta_, dk, dv, *st, *sd, *tail, *extra)
                    grid, ref, got = (-(-T // A.BM), Hkv, Bsz), dkm if padded else dk0, dk
                run = lambda kern=kern, grid=grid, args=args, sm=sm: kern(grid, (A.THREADS, 1, 1), args, shared_mem=sm)  # noqa: E731
                us = timed(run)
                err = float(cp.abs(got.astype(cp.float32) - ref.astype(cp.float32)).max())
                flops = f * {"fwd": 1.0, "dq": 1.5, "dkdv": 2.0}[kind]  # the unmasked count, also when padded
                label = name + ("" if mname is None else f" [{mname}]")
                print(f"  {label:<34} regs {kern.num_regs:3d}  {us:9.1f} us  {flops / us / 1e6:6.0f} "
                      f"TFLOP/s(model)  max|diff| {err:.3g}")


if __name__ == "__main__":
    main()
