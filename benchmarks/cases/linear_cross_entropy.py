"""Benchmark cases for ck.linear_cross_entropy (cukernels/ops/linear_cross_entropy.py: ck.matmul + the
cross_entropy kernels in row chunks).

Compute-bound: the TFLOP/s column counts the model FLOPs (fwd+bwd: 3 GEMMs of 2 N H V; eval: one). "x cupy" is
the unfused composite on the full [N, V] logits (ck.matmul -> ck.cross_entropy_fused in place -> the two
gradient matmuls), "x torch" PyTorch's F.linear + F.cross_entropy(logits.float()) + autograd (the Hugging Face
head: it upcasts the logits). The note carries the peak memory each path allocates above its inputs (x, W,
targets and, for ours and the composite, the fp32 weight gradient that training holds anyway), measured before
the timing: CuPy paths under a private memory pool (its total_bytes() after one call is the high-water mark:
nothing is released to the device during the call), PyTorch with max_memory_allocated (its bf16 dW and dx
outputs included).
"""
import cukernels as ck
from bench_ops import Case
from cukernels.ops.linear_cross_entropy import chunk_rows_for, linear_cross_entropy

# (N, H, V): LLaMA-3.2-1B's head at B8 x T1024 (issue 17: <= 25 ms fwd+bwd, <= 0.6 GB), GPT-2 small's at 8k tokens
SHAPES = [(8192, 2048, 128256), (8192, 768, 50257)]
GB = 1e9


def _peak_cupy(cp, fn):
    """Bytes a call holds at its high-water mark (private pool; the call's results are dropped before reading)."""
    cp.cuda.Device().synchronize()
    pool = cp.cuda.MemoryPool()
    with cp.cuda.using_allocator(pool.malloc):
        fn(0)
        cp.cuda.Device().synchronize()
    b = pool.total_bytes()
    pool.free_all_blocks()
    return b


def _peak_torch(torch, fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    r = fn(0)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del r
    torch.cuda.empty_cache()
    return peak


def cases(ctx):
    cp, torch = ctx.cp, ctx.torch
    out = []
    for N, H, V in (SHAPES[1:] if ctx.quick else SHAPES):
        s = 2
        x = cp.random.standard_normal((N, H), dtype=cp.float32).astype(ck.bfloat16)
        w = (cp.random.standard_normal((V, H), dtype=cp.float32) * (H ** -0.5)).astype(ck.bfloat16)
        t = cp.random.randint(0, V, N, dtype=cp.int32)
        gw = cp.zeros((V, H), dtype=cp.float32)  # the master weight's fp32 gradient (exists in training)
        C = chunk_rows_for(N, V, s)
        n = -(-N // C)

        def ours(i, x=x, w=w, t=t, gw=gw):
            return linear_cross_entropy(x, w, t, grad_weight=gw)

        def ours_eval(i, x=x, w=w, t=t):
            return linear_cross_entropy(x, w, t, compute_grad=False)

        def unfused(i, x=x, w=w, t=t, gw=gw):
            z = ck.matmul(x, w, trans_b=True)  # [N, V] bf16: all the logits
            loss, _ = ck.cross_entropy_fused(z, t, out=z)
            dx = ck.matmul(z, w)
            ck.matmul(z, x, trans_a=True, out=gw)
            return loss, dx, gw

        def unfused_eval(i, x=x, w=w, t=t):
            return ck.cross_entropy(ck.matmul(x, w, trans_b=True), t)

        ours(0), unfused(0)  # warm-up: kernels compiled, cuBLAS handle and its workspace created
        mem = dict(ours=_peak_cupy(cp, ours), unfused=_peak_cupy(cp, unfused),
                   fresh_dw=_peak_cupy(cp, lambda i, x=x, w=w, t=t: linear_cross_entropy(x, w, t)))
        tfb = tf = None
        if torch is not None:
            F = torch.nn.functional
            tx, tw = ctx.t(x).requires_grad_(True), ctx.t(w).requires_grad_(True)
            tt = torch.as_tensor(t, device="cuda").long()

            def tfb(i, tx=tx, tw=tw, tt=tt):
                loss = F.cross_entropy(F.linear(tx, tw).float(), tt)
                return torch.autograd.grad(loss, (tx, tw))

            def tf(i, tx=tx, tw=tw, tt=tt):
                with torch.no_grad():
                    return F.cross_entropy(F.linear(tx, tw).float(), tt)

            mem["torch"] = _peak_torch(torch, tfb)
        note = (f"{n} chunks of {C} rows; peak extra GB: ours {mem['ours'] / GB:.2f} (fresh fp32 dW: "
                f"{mem['fresh_dw'] / GB:.2f}), unfused {mem['unfused'] / GB:.2f}"
                + (f", torch {mem['torch'] / GB:.2f}" if "torch" in mem else ""))
        print(f"  linear_cross_entropy {N}x{H}x{V}: {note}", flush=True)
        shape = f"{N}x{H}x{V}"
        flops = 2.0 * N * H * V
        # HBM bytes of the chunked path: the logits written, CE-read + written, read by the dx and dW GEMMs
        # (4 N V s with CE's re-read from L2), W read by 2 GEMMs per chunk, the fp32 dW read + written by every
        # chunk but the first (written), x read 3x and dx written.
        nbytes = 4 * N * V * s + 2 * n * V * H * s + (2 * n - 1) * 4 * V * H + 4 * N * H * s
        out.append(Case("linear_cross_entropy fwd+bwd", shape, "bf16", nbytes,
                        "4NVs + 2nVHs + (2n-1)4VH + 4NHs", ours, unfused, tfb, note=note,
                        extra=dict(nsets=1, mem=mem, chunk_rows=C), flops=3 * flops))
        if V % 64 == 0:
            # grad_fp8: the two gradient GEMMs on FP8 operands (dlogits E5M2 from the CE kernel, then their byte
            # transpose; x and W cast in E4M3); "x cupy" is the bf16-gradient op of the row above.
            def ours8(i, x=x, w=w, t=t, gw=gw):
                return linear_cross_entropy(x, w, t, grad_weight=gw, grad_fp8=ck.float8_e5m2)

            ours8(0)
            # logits written + CE-read (2NVs), codes written, transposed (read + write) and read by the two GEMMs
            # (5NV), W cast with its transpose (VH(2s + 2) after its amax read VHs), the logits GEMM's W reads
            # (nVHs), the FP8 W reads (2nVH), the fp32 dW (2n-1)4VH, x and dx 4NHs
            nb8 = (2 * N * V * s + 5 * N * V + V * H * (3 * s + 2) + n * V * H * s + 2 * n * V * H
                   + (2 * n - 1) * 4 * V * H + 4 * N * H * s)
            out.append(Case("linear_cross_entropy fwd+bwd, FP8 grads", shape, "bf16", nb8,
                            "2NVs + 5NV + VH(3s+2) + nVH(s+2) + (2n-1)4VH + 4NHs", ours8, ours, None,
                            note="grad_fp8=E5M2; x cupy: against the bf16-gradient op (row above)",
                            extra=dict(nsets=1, chunk_rows=C), flops=3 * flops))
        out.append(Case("linear_cross_entropy eval", shape, "bf16", 2 * N * V * s + n * V * H * s,
                        "2NVs + nVHs", ours_eval, unfused_eval, tf, note="compute_grad=False (loss only)",
                        extra=dict(nsets=1), flops=flops))
        if V % 64:
            # The model's layout for a vocabulary that is no multiple of 64 (GPT-2): W in a zero-padded [Vp, H]
            # buffer, num_classes=V, so the logits GEMM's N and the dx GEMM's K are Vp (cuBLAS keeps its align1
            # kernels for an odd V there, whatever the leading dimension). Composite: the GPT-2 Linear(pad_rows)
            # + in-place cross-entropy path on the full [N, Vp] logits.
            Vp = -(-V // 64) * 64
            wp = cp.zeros((Vp, H), dtype=w.dtype)
            wp[:V] = w

            def ours_p(i, x=x, wp=wp, t=t, gw=gw, V=V):
                return linear_cross_entropy(x, wp, t, grad_weight=gw, num_classes=V)

            def unfused_p(i, x=x, wp=wp, t=t, gw=gw, V=V):
                z = ck.matmul(x, wp, trans_b=True)  # [N, Vp]: padding logits exactly 0, never written by CE
                loss, _ = ck.cross_entropy_fused(z[:, :V], t, out=z[:, :V])
                dx = ck.matmul(z, wp)
                ck.matmul(z[:, :V], x, trans_a=True, out=gw)
                return loss, dx, gw

            ours_p(0), unfused_p(0)
            memp = dict(ours=_peak_cupy(cp, ours_p), unfused=_peak_cupy(cp, unfused_p))
            notep = (f"W padded to {Vp} rows, num_classes={V}; peak extra GB: ours {memp['ours'] / GB:.2f}, "
                     f"unfused {memp['unfused'] / GB:.2f}")
            print(f"  linear_cross_entropy {N}x{H}x{V} padded W: {notep}", flush=True)
            nb = 4 * N * Vp * s + 2 * n * Vp * H * s + (2 * n - 1) * 4 * V * H + 4 * N * H * s
            out.append(Case("linear_cross_entropy fwd+bwd, W padded", shape, "bf16", nb,
                            "4NVps + 2nVpHs + (2n-1)4VH + 4NHs", ours_p, unfused_p, tfb, note=notep,
                            extra=dict(nsets=1, mem=memp, chunk_rows=C, padded_rows=Vp), flops=3 * flops))
    return out
