"""Question: where does the B = 1 decode GEMV's ~5 us fixed cost go? Per-GEMV time inside a captured chain under
PDL (what a decode step sees), for the LLaMA-3.2-1B B = 1 shapes, with and without the fused norm prologue.
``CUKERNELS_GEMV_DEPTH=n`` overrides ck.settings.gemv_depth (the per-lane cp.async ring's stages).

Answer (2026-11-30, one H200, ``python dev/gemv_chain.py``): with the register-tile kernel the norm prologue cost
2.0-2.2 us of every GEMV that had one (qkv 6.11 us with it, 4.10 without, floor 3.00) and a K = 8192 row had one chunk
in flight (down 11.93 us, floor 7.99). After the one-pass prologue and the per-lane cp.async ring: qkv + rms 5.21-5.75
us, gate_up 18.21 (depth 3) / 17.51 (depth 4), down 10.48 (depth 4); the four GEMVs of a layer chained 41.93 ->
38.75 us. Kept: depth 3, 4 for K >= 4096 (benchmarks/NOTES.md, "gemv").

    PYTHONPATH=. python dev/gemv_chain.py [--reps 64] [--B 1]
"""
from __future__ import annotations

import argparse

import cupy as cp

import cukernels as ck
from cukernels.ops import _launch


def chain_us(fn, reps: int, iters: int = 20) -> float:
    """Microseconds per call of ``fn`` in a captured graph of ``reps`` back-to-back calls (PDL scope open)."""
    s = cp.cuda.Stream(non_blocking=True)
    with s, _launch.pdl_scope():
        for _ in range(3):
            fn()
        s.synchronize()
        s.begin_capture()
        for _ in range(reps):
            fn()
        g = s.end_capture()
        g.upload()
        g.launch()
        s.synchronize()
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(s)
        for _ in range(iters):
            g.launch()
        e1.record(s)
        e1.synchronize()
    return cp.cuda.get_elapsed_time(e0, e1) * 1e3 / (iters * reps)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=64)
    ap.add_argument("--B", type=int, default=1)
    a = ap.parse_args(argv)
    print(f"gemv_depth = {ck.settings.gemv_depth}, gemv_prefetch_kb = {ck.settings.gemv_prefetch_kb}")
    bf = ck.bfloat16
    H, I, V, B = 2048, 8192, 128256, a.B
    rng = cp.random.default_rng(0)

    def w(n, k):
        # a distinct weight per call in the chain would exceed L2 reuse effects: use `reps` / 8 copies in rotation
        return [(rng.standard_normal((n, k), dtype=cp.float32) * k ** -0.5).astype(bf) for _ in range(4)]

    x = rng.standard_normal((B, H), dtype=cp.float32).astype(bf)
    xi = rng.standard_normal((B, I), dtype=cp.float32).astype(bf)
    nw = (1 + 0.1 * rng.standard_normal(H, dtype=cp.float32)).astype(bf)
    res = rng.standard_normal((B, H), dtype=cp.float32).astype(bf)
    rows = []
    Wqkv, Wo, Wgu, Wd = w(3072, H), w(H, H), w(2 * I, H), w(H, I)
    o_qkv = cp.empty((B, 3072), bf); o_h = cp.empty((B, H), bf); o_i = cp.empty((B, I), bf)
    cnt = [0]

    def rot(ws):
        cnt[0] += 1
        return ws[cnt[0] % len(ws)]

    cases = [
        ("qkv rms", 12.58e6, lambda: ck.gemv(x, rot(Wqkv), norm="rms", norm_weight=nw, out=o_qkv)),
        ("qkv none", 12.58e6, lambda: ck.gemv(x, rot(Wqkv), out=o_qkv)),
        ("o +res", 8.39e6, lambda: ck.gemv(x, rot(Wo), residual=res, out=o_h)),
        ("o none", 8.39e6, lambda: ck.gemv(x, rot(Wo), out=o_h)),
        ("gate_up rms swiglu", 67.1e6, lambda: ck.gemv(x, rot(Wgu), norm="rms", norm_weight=nw, act="swiglu", out=o_i)),
        ("gate_up none swiglu", 67.1e6, lambda: ck.gemv(x, rot(Wgu), act="swiglu", out=o_i)),
        ("down +res", 33.55e6, lambda: ck.gemv(xi, rot(Wd), residual=res, out=o_h)),
    ]
    print(f"gemv in a captured chain of {a.reps} under PDL (pdl_enabled={_launch.pdl_enabled()}), B{B}, 4 weights in rotation")
    for name, nbytes, fn in cases:
        us = chain_us(fn, a.reps)
        print(f"  {name:22s} {us:7.2f} us   {nbytes / us / 1e6:6.2f} TB/s   floor@4.2 {nbytes / 4.2e6:5.2f} us")
    layer = lambda: (ck.gemv(x, rot(Wqkv), norm="rms", norm_weight=nw, out=o_qkv),
                     ck.gemv(x, rot(Wo), residual=res, out=o_h),
                     ck.gemv(x, rot(Wgu), norm="rms", norm_weight=nw, act="swiglu", out=o_i),
                     ck.gemv(xi, rot(Wd), residual=res, out=o_h))
    us = chain_us(layer, 16)
    print(f"  layer (4 gemvs)        {us:7.2f} us   floor@4.2 {121.6e6 / 4.2e6:5.2f} us")


if __name__ == "__main__":
    main()
