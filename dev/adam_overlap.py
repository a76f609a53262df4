"""Question: does AdamW hide under the next forward's GEMMs? (issue 17: B8xT1024 <= 112 ms; Adam is 8.9 ms of the
step.) If it did, a deferred update (layer i's forward waiting only for its own bucket's update) would pay.

Answer (2026-12-01, one H200, ``python dev/adam_overlap.py``): barely. Forward alone 21.87 ms, Adam alone 7.52, serial
29.80; the best overlap (forward stream at high priority, occupancy 1) 28.69 ms: -1.1 ms, 15 % of the update hidden,
against -3 to -6 predicted. cuBLAS' persistent GEMM CTAs hold a whole SM each, so the update only gets SMs between
GEMMs. Every variant's parameters are bit-identical to serial. Dropped: not worth the deferred update's hazards
(benchmarks/NOTES.md, "adam").

The stand-in for LLaMA-3.2-1B's forward at B8xT1024 on one GPU: per layer the four bf16 GEMMs of the packed
projections (8192 tokens; qkv 2048 -> 3072, o 2048 -> 2048, gate/up 2048 -> 16384, down 8192 -> 2048; ~1.0
TFLOP a layer, ~1.4 ms at 700 TFLOP/s), 16 layers; and ck.adam_step over 16 buckets of the layers' parameters
(fp32 gradients, bf16 shadows: 30 B an element).

Serial: every bucket's update, then the forward. Overlapped: the updates on a side stream in forward order, each
layer's GEMMs waiting for its own bucket's event, with the side stream's priority and the update's grid depth
(occupancy) varied. Prints ms per variant (CUDA events, median of 5 after 2 warm-ups) and the check that each
variant's parameters equal the serial one's.

    PYTHONPATH=. python dev/adam_overlap.py [--tokens 8192] [--layers 16]
"""
import argparse
import statistics

import cupy as cp
import numpy as np

import cukernels as ck


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=16)
    a = ap.parse_args()
    N, H, L = a.tokens, 2048, a.layers
    outs = [(H, 3072), (H, H), (H, 16384), (8192, H)]  # (in, out) of each GEMM a layer
    per_layer = sum(i * o for i, o in outs)
    bf = ck.bfloat16
    rng = cp.random.default_rng(0)
    W = [[(rng.standard_normal((o, i), dtype=cp.float32) * 0.02).astype(bf) for i, o in outs] for _ in range(L)]
    X = [rng.standard_normal((N, i), dtype=cp.float32).astype(bf) for i, _ in outs]
    Y = [cp.empty((N, o), dtype=bf) for _, o in outs]
    n = per_layer * L
    P0 = rng.standard_normal(n, dtype=cp.float32)
    G = rng.standard_normal(n, dtype=cp.float32) * 1e-3
    M0 = cp.zeros(n, cp.float32)
    V0 = cp.zeros(n, cp.float32)
    P, M, V, S = P0.copy(), M0.copy(), V0.copy(), cp.empty(n, dtype=bf)
    lr, step = cp.full((), 1e-3, cp.float32), cp.full((), 1, cp.int32)
    print(f"{L} layers x {per_layer / 1e6:.1f}M params ({n / 1e9:.3f}e9), forward {2 * N * per_layer * L / 1e12:.1f} "
          f"TFLOP, Adam {n * 30 / 1e9:.1f} GB")

    def reset():  # then a device sync: the timed streams are non-blocking, unordered with these copies
        P[...] = P0
        M[...] = M0
        V[...] = V0
        cp.cuda.Device().synchronize()

    def adam(i, occ):
        sl = slice(i * per_layer, (i + 1) * per_layer)
        ck.adam_step(P[sl], G[sl], M[sl], V[sl], lr=lr, step=step, weight_decay=0.1, shadow=S[sl], occupancy=occ)

    def layer(i):
        for w, x, y in zip(W[i], X, Y):
            ck.matmul(x, w, trans_b=True, out=y)

    lo, hi = 0, -100  # (CUDA clamps -100 to the device's highest priority)
    main_s = cp.cuda.Stream(non_blocking=True)
    main_hi = cp.cuda.Stream(non_blocking=True, priority=hi)

    def run(variant):
        kind, occ, side_prio, main_stream = variant
        reset()
        with main_stream:
            ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
            ev0.record()
            if kind == "serial":
                for i in range(L):
                    adam(i, occ)
                for i in range(L):
                    layer(i)
            elif kind == "forward":
                for i in range(L):
                    layer(i)
            elif kind == "adam":
                for i in range(L):
                    adam(i, occ)
            else:
                side = cp.cuda.Stream(non_blocking=True, priority=side_prio)
                start = cp.cuda.Event(disable_timing=True)
                start.record()
                side.wait_event(start)
                evs = []
                with side:
                    for i in range(L):
                        adam(i, occ)
                        e = cp.cuda.Event(disable_timing=True)
                        e.record(side)
                        evs.append(e)
                for i in range(L):
                    main_stream.wait_event(evs[i])
                    layer(i)
                main_stream.wait_event(evs[-1])
            ev1.record()
            ev1.synchronize()
            return cp.cuda.get_elapsed_time(ev0, ev1)

    variants = {
        "forward alone": ("forward", 1.0, lo, main_s),
        "adam alone": ("adam", 1.0, lo, main_s),
        "serial (today)": ("serial", 1.0, lo, main_s),
        "overlap, same priority, occ 1": ("overlap", 1.0, lo, main_s),
        "overlap, same priority, occ 8": ("overlap", 8.0, lo, main_s),
        "overlap, forward high prio, occ 1": ("overlap", 1.0, lo, main_hi),
        "overlap, forward high prio, occ 8": ("overlap", 8.0, lo, main_hi),
        "overlap, forward high prio, occ 0.25": ("overlap", 0.25, lo, main_hi),
        "overlap, forward high prio, occ 0.5": ("overlap", 0.5, lo, main_hi),
    }
    ref = None
    for name, v in variants.items():
        ts = [run(v) for _ in range(7)][2:]
        same = ""
        if v[0] in ("serial", "overlap"):
            p = P.get()
            ref = p if ref is None else ref
            same = "  params == serial" if np.array_equal(p, ref) else "  PARAMS DIFFER"
        print(f"{name:<40} {statistics.median(ts):8.2f} ms  (min {min(ts):.2f}){same}", flush=True)


if __name__ == "__main__":
    main()
