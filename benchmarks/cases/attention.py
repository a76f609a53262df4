"""Benchmark cases for ck.flash_attention / ck.flash_attention_backward (kernels_cu/attention.cu).

Compute-bound: the row's TFLOP/s counts the model FLOPs (4 B H Tq Tk D forward, halved under the causal mask;
backward 2.5x forward), not the recomputation. "x cupy" is the materialised path the model used before
(ck.matmul -> ck.attn_softmax -> ck.matmul, grouped-query layout), "x torch" PyTorch's
scaled_dot_product_attention (its flash backend) on the same [B, T, H, D] views.
"""
import math

import cukernels as ck
from bench_ops import Case

# (B, T, H, Hkv, D, causal): LLaMA-3.2-1B at the B8 x T1024 training shape, a long sequence, 128-wide heads.
SHAPES = [(8, 1024, 32, 8, 64, True), (2, 4096, 32, 8, 64, True), (8, 1024, 16, 16, 128, True),
          (8, 1024, 32, 8, 64, False)]


def cases(ctx):
    cp, torch = ctx.cp, ctx.torch
    out = []
    for Bsz, T, H, Hkv, D, causal in (SHAPES[:1] if ctx.quick else SHAPES):
        G = H // Hkv
        r = lambda *s: cp.random.standard_normal(s, dtype=cp.float32).astype(ck.bfloat16)  # noqa: E731
        per_set = (2 * Bsz * T * H * D + 2 * Bsz * T * Hkv * D) * 2
        k_ = min(ctx.nsets(per_set), 3)
        qs = [r(Bsz, T, H, D) for _ in range(k_)]
        ks = [r(Bsz, T, Hkv, D) for _ in range(k_)]
        vs = [r(Bsz, T, Hkv, D) for _ in range(k_)]
        dos = [r(Bsz, T, H, D) for _ in range(k_)]
        fw = [ck.flash_attention(qs[i], ks[i], vs[i], causal=causal, return_lse=True) for i in range(k_)]
        scale = 1.0 / math.sqrt(D)
        f_fwd = 4.0 * Bsz * H * T * T * D * (0.5 if causal else 1.0)

        def mat_fwd(i, qs=qs, ks=ks, vs=vs, Bsz=Bsz, T=T, H=H, Hkv=Hkv, G=G, D=D, causal=causal, scale=scale):
            # the model's previous path: grouped [B, Hkv, G*T, D] GEMMs around attn_softmax
            q = cp.ascontiguousarray(qs[i].transpose(0, 2, 1, 3)).reshape(Bsz, Hkv, G * T, D)
            kk = cp.ascontiguousarray(ks[i].transpose(0, 2, 1, 3))
            vv = cp.ascontiguousarray(vs[i].transpose(0, 2, 1, 3))
            s = ck.matmul(q, kk, trans_b=True).reshape(Bsz, H, T, T)
            p = ck.attn_softmax(s, causal=causal, scale=scale)
            return ck.matmul(p.reshape(Bsz, Hkv, G * T, T), vv)

        tf = tfb = None  # noqa: F841 (defined below when torch is importable)
        if torch is not None:
            import torch.nn.functional as Fn

            tq = [ctx.t(x).transpose(1, 2).requires_grad_(True) for x in qs]
            tk = [ctx.t(x).transpose(1, 2).requires_grad_(True) for x in ks]
            tv = [ctx.t(x).transpose(1, 2).requires_grad_(True) for x in vs]
            tdo = [ctx.t(x).transpose(1, 2) for x in dos]

            def tf(i, tq=tq, tk=tk, tv=tv, causal=causal):
                with torch.no_grad():
                    return Fn.scaled_dot_product_attention(tq[i], tk[i], tv[i], is_causal=causal, enable_gqa=True)

            def tfb(i, tq=tq, tk=tk, tv=tv, tdo=tdo, causal=causal):
                o = Fn.scaled_dot_product_attention(tq[i], tk[i], tv[i], is_causal=causal, enable_gqa=True)
                return torch.autograd.grad(o, (tq[i], tk[i], tv[i]), tdo[i])

        shape = f"{Bsz}x{T}x{H}/{Hkv}x{D}" + ("" if causal else " full")
        io = per_set
        out.append(Case("flash_attention fwd", shape, "bf16", io, "q,k,v,o once",
                        lambda i, qs=qs, ks=ks, vs=vs, causal=causal: ck.flash_attention(
                            qs[i], ks[i], vs[i], causal=causal, return_lse=True),
                        mat_fwd, tf, extra=dict(nsets=k_), flops=f_fwd))
        out.append(Case("flash_attention bwd", shape, "bf16", 2 * io, "q,k,v,o,dO,dq,dk,dv once",
                        lambda i, qs=qs, ks=ks, vs=vs, dos=dos, fw=fw, causal=causal: ck.flash_attention_backward(
                            dos[i], qs[i], ks[i], vs[i], fw[i][0], fw[i][1], causal=causal),
                        None, None, extra=dict(nsets=k_), flops=2.5 * f_fwd))

        def ours_fb(i, qs=qs, ks=ks, vs=vs, dos=dos, causal=causal):
            o, lse = ck.flash_attention(qs[i], ks[i], vs[i], causal=causal, return_lse=True)
            return ck.flash_attention_backward(dos[i], qs[i], ks[i], vs[i], o, lse, causal=causal)

        out.append(Case("flash_attention fwd+bwd", shape, "bf16", 3 * io, "fwd + bwd", ours_fb, None, tfb,
                        extra=dict(nsets=k_), flops=3.5 * f_fwd))
    return out
