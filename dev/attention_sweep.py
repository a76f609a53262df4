"""Question: where does the sm_90 attention kernels' time go: a fixed cost per CTA (prologue, epilogue, wave tail)
or the per-tile work? Each kernel (fwd, bwd dq, bwd dkdv) is timed alone over a sweep of sequence lengths at a fixed
token count, causal and full, with one CTA per work tile and with the persistent grid, then fitted per kernel to

    time x SMs = fixed x CTAs + per_tile x tiles        (least squares over the sweep, one CTA per tile)

PyTorch's SDPA (cuDNN / flash) forward and forward+backward are timed beside for reference. GPU only (sm_90).

Answer (2026-12-01, one H200, ``python dev/attention_sweep.py``; H32/8, D64, 8192 tokens a call), before the
kernels were persistent: fwd 3.93 us a CTA + 1.26 us a tile, dq 4.03 + 0.98, dkdv 11.3 + 1.31 (fit error 3 / 6 /
20 %); the fixed part was 41 / 32 / 18 % of B8xT1024 causal and 15 / 11 / 6 % of B2xT4096. That led to the persistent
kernels (fwd B8xT1024 causal 151 -> 136 us) and, from the same sweep over the forward variants, the
``ck.settings.attention_sm90_variant = "auto"`` policy of cukernels/ops/attention_sm90.py (benchmarks/NOTES.md,
"flash_attention_sm90").

    PYTHONPATH=. python dev/attention_sweep.py [--tokens 8192] [--reps 20] [--dim 128 --heads 16/16 --seqs 1024,4096]
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import cupy as cp

sys.path.insert(0, ".")
import cukernels as ck  # noqa: E402
from cukernels.ops import attention_sm90 as A  # noqa: E402


def _time(fn, reps):
    for _ in range(2):
        fn()
    s, e = cp.cuda.Event(), cp.cuda.Event()
    best = []
    for _ in range(3):
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        e.synchronize()
        best.append(cp.cuda.get_elapsed_time(s, e) / reps * 1e3)
    return min(best)  # microseconds


def _work(T, H, Hkv, D, causal, frows=128):
    """(work tiles, inner tiles) of the three kernels per batch row: fwd (frows query rows, BN-key tiles), dq
    (128 rows, 64-key tiles), dkdv (128 keys, BQ-query tiles x G heads)."""
    bn = A.CONFIG[D][0]
    dbn, _, bq = A.BWD_CONFIG[D][:3]
    nmb, G = -(-T // 128), H // Hkv
    fw = sum(-(-(min(T, q0 + frows) if causal else T) // bn) for q0 in range(0, T, frows))
    dq = sum(-(-(min(T, q0 + 128) if causal else T) // dbn) for q0 in range(0, T, 128))
    nqb = -(-T // bq)
    kv = sum(G * (nqb - (k0 // bq if causal else 0)) for k0 in range(0, T, 128))
    return {"fwd": (-(-T // frows) * H, fw * H), "dq": (nmb * H, dq * H), "dkdv": (nmb * Hkv, kv * Hkv)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--heads", default="32/8")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--seqs", type=lambda t: [int(x) for x in t.split(",")], default=[256, 512, 1024, 2048, 4096])
    a = ap.parse_args()
    H, Hkv = map(int, a.heads.split("/"))
    D = a.dim
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    try:
        import torch
        import torch.nn.functional as F
    except Exception:
        torch = None
    rows = []
    print(f"H{H}/{Hkv} D{D}, {a.tokens} tokens a call, {sms} SMs; times in us (best of 3 x {a.reps})")
    print(f"{'T':>5s} {'B':>3s} {'causal':>6s} {'grid':>8s} | {'fwd':>7s} {'dq':>7s} {'dkdv':>7s} {'bwd':>7s} | "
          f"{'sdpa fwd':>8s} {'sdpa bwd':>8s} | fwd x bwd x  f+b x")
    for causal in (True, False):
        for T in a.seqs:
            Bsz = max(1, a.tokens // T)
            r = lambda *s: cp.random.standard_normal(s, dtype=cp.float32).astype(ck.bfloat16)
            q, k, v, do = r(Bsz, T, H, D), r(Bsz, T, Hkv, D), r(Bsz, T, Hkv, D), r(Bsz, T, H, D)
            o, lse = A.flash_attention_sm90(q, k, v, causal=causal, return_lse=True)
            dq, dk, dv = (cp.empty_like(q), cp.empty_like(k), cp.empty_like(v))
            delta = cp.empty((Bsz, H, T), dtype=cp.float32)
            sq, sk, sv, sd = (A._strides(n, x) for n, x in (("q", q), ("k", k), ("v", v), ("dout", do)))
            tail = (np.int32(T), np.int32(T), np.int32(H), np.int32(Hkv), np.float32(D ** -0.5), np.bool_(causal))
            fvar = A.fwd_variant(D, seq_k=T, causal=causal)
            kf, smf = A._kernel(D, fvar)
            *_, frows, fthr = A.fwd_shape(D, fvar)
            kq, smq = A._kernel(D, ck.settings.attention_sm90_bwd_variant, "dq")
            kd, smd = A._kernel(D, ck.settings.attention_sm90_bwd_variant, "dkdv")
            tail = (*tail, np.int32(Bsz))
            norope = A._rope_args(None, Bsz, T, T, D)
            nmb = -(-T // 128)
            tq_, tkv = nmb * H * Bsz, nmb * Hkv * Bsz
            tp = {}
            for persistent in (False, True):  # one CTA per work tile (the old schedule), then persistent CTAs
                ck.settings.attention_sm90_persistent = persistent
                tp[persistent] = {
                    "fwd": _time(lambda: kf((A.grid(-(-T // frows) * H * Bsz),), (fthr, 1, 1),
                                            (q, k, v, o, lse, *sq, *sk, *sv, *tail), shared_mem=smf), a.reps),
                    "dq": _time(lambda: kq((A.grid(tq_),), (A.THREADS, 1, 1),
                                           (q, k, v, o, do, lse, delta, dq, *sq, *sk, *sv, *sd, *tail, *sq, *norope),
                                           shared_mem=smq), a.reps),
                    "dkdv": _time(lambda: kd((A.grid(tkv),), (A.THREADS, 1, 1),
                                             (q, k, v, do, lse, delta, dk, dv, *sq, *sk, *sv, *sd, *tail, *sk, *norope),
                                             shared_mem=smd), a.reps),
                }
            ck.settings.attention_sm90_persistent = True
            for var in A.VARIANTS:  # the forward's other consumer loops, persistent grid
                if var != fvar and A.fwd_variant(D, var) == var:
                    kv_, smv = A._kernel(D, var)
                    *_, vrows, thr = A.fwd_shape(D, var)
                    tv_ = _time(lambda: kv_((A.grid(-(-T // vrows) * H * Bsz),), (thr, 1, 1),
                                            (q, k, v, o, lse, *sq, *sk, *sv, *tail), shared_mem=smv), a.reps)
                    print(f"      T{T} {'causal' if causal else 'full'}: fwd {var.strip('_') or 'pingpong':8s} "
                          f"{tv_:7.1f} us (auto = {fvar.strip('_') or 'pingpong'}: {tp[True]['fwd']:.1f})")
            t = tp[False]
            tf = tb = float("nan")
            if torch is not None:
                tq = torch.randn(Bsz, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                tk = torch.randn(Bsz, Hkv, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                tv = torch.randn(Bsz, Hkv, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                tdo = torch.randn(Bsz, H, T, D, device="cuda", dtype=torch.bfloat16)
                fw = lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, enable_gqa=True)
                to = fw()
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
                best_f, best_b = [], []
                for _ in range(3):
                    ev[0].record()
                    for _ in range(a.reps):
                        fw()
                    ev[1].record()
                    for _ in range(a.reps):
                        torch.autograd.grad(to, (tq, tk, tv), tdo, retain_graph=True)
                    ev[2].record()
                    torch.cuda.synchronize()
                    best_f.append(ev[0].elapsed_time(ev[1]) / a.reps * 1e3)
                    best_b.append(ev[1].elapsed_time(ev[2]) / a.reps * 1e3)
                tf, tb = min(best_f), min(best_b)
            for persistent in (False, True):
                t_ = tp[persistent]
                bwd = t_["dq"] + t_["dkdv"]
                print(f"{T:5d} {Bsz:3d} {str(causal):>6s} {'persist' if persistent else 'per-tile':>8s} | "
                      f"{t_['fwd']:7.1f} {t_['dq']:7.1f} {t_['dkdv']:7.1f} {bwd:7.1f} | "
                      f"{tf:8.1f} {tb:8.1f} | {tf / t_['fwd']:.2f}x {tb / bwd:.2f}x "
                      f"{(tf + tb) / (t_['fwd'] + bwd):.2f}x")
            w = _work(T, H, Hkv, D, causal, frows)
            for kname in t:
                c, n = w[kname]
                rows.append((kname if kname != "fwd" else f"fwd{fvar}", T, causal, Bsz * c, Bsz * n, t[kname]))
            del q, k, v, do, o, lse, dq, dk, dv, delta
    print("\nfit per kernel, one CTA per tile: time x SMs = fixed x CTAs + per_tile x tiles (us of one SM)")
    for kname in sorted({r[0] for r in rows}):  # the forward per variant ("auto" switches with T)
        R = [r for r in rows if r[0] == kname]
        if len(R) < 3:
            continue
        X = np.array([[r[3], r[4]] for r in R], dtype=np.float64)
        y = np.array([r[5] * sms for r in R])
        (c0, c1), *_ = np.linalg.lstsq(X, y, rcond=None)
        worst = max(abs(X[i] @ (c0, c1) - y[i]) / y[i] for i in range(len(R)))
        print(f"  {kname:5s} fixed {c0:6.2f} us a CTA, {c1:6.3f} us a tile (worst fit error {worst:.0%})")
        for r in R:
            if (r[1] in (1024, 4096)) and r[2]:
                share = c0 * r[3] / (r[5] * sms)
                print(f"        T{r[1]} causal: {r[3]} CTAs, {r[4]} tiles, {r[5]:.1f} us; fixed part {share:.0%}")


if __name__ == "__main__":
    main()
