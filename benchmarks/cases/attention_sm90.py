"""Benchmark cases for ck.flash_attention_sm90 / ck.flash_attention_backward_sm90 (kernels_cu/attention_sm90.cu:
wgmma, sm_90 GPUs only; no rows on other GPUs).

Compute-bound: TFLOP/s count the model FLOPs (4 B H Tq Tk D forward, halved under the causal mask; backward 2.5x
forward, fwd+bwd 3.5x). The "x cupy" column is the mma.sync kernels (ck.flash_attention /
ck.flash_attention_backward, attention.cu) on the same inputs, the "x torch" column PyTorch's
scaled_dot_product_attention (cuDNN / flash backend) on the same [B, T, H, D] views, timed in the same run
("fwd+bwd": SDPA's forward + autograd backward).

Sliding-window rows (not in --quick): cases/attention.py's window_cases on these kernels, at WINDOWED: each shape
causal without and with the window; the windowed rows' "x cupy" is the no-window call, "x torch" FlexAttention.
"""
import math

import cukernels as ck
from bench_ops import Case
from cases.attention import window_cases

# (B, T, H, Hkv, D, window): Mistral-7B's heads and window at 8192 tokens, and head_dim 64 (the fused backward)
WINDOWED = [(2, 8192, 32, 8, 128, 4096), (2, 8192, 32, 8, 64, 4096)]

# (B, T, H, Hkv, D, causal): the issue-17 targets (LLaMA-3.2-1B training shape, a long sequence), 128-wide heads,
# and the full (non-causal) mask.
SHAPES = [(8, 1024, 32, 8, 64, True), (2, 4096, 32, 8, 64, True), (8, 1024, 16, 16, 128, True),
          (8, 1024, 32, 8, 64, False)]


def cases(ctx):
    from cukernels.ops import attention_sm90 as A90

    if not A90.supported():
        return []
    if ctx.group == "window":  # (bench_ops.py --group window)
        return window_cases(ctx, "flash_attention_sm90", _fwd, _bwd, shapes=WINDOWED)
    cp, torch = ctx.cp, ctx.torch
    out = []
    for Bsz, T, H, Hkv, D, causal in (SHAPES[:2] if ctx.quick else SHAPES):
        r = lambda *s: cp.random.standard_normal(s, dtype=cp.float32).astype(ck.bfloat16)  # noqa: E731
        per_set = (2 * Bsz * T * H * D + 2 * Bsz * T * Hkv * D) * 2
        k_ = min(ctx.nsets(per_set), 3)
        qs = [r(Bsz, T, H, D) for _ in range(k_)]
        ks = [r(Bsz, T, Hkv, D) for _ in range(k_)]
        vs = [r(Bsz, T, Hkv, D) for _ in range(k_)]
        dos = [r(Bsz, T, H, D) for _ in range(k_)]
        f_fwd = 4.0 * Bsz * H * T * T * D * (0.5 if causal else 1.0)

        def ours(i, qs=qs, ks=ks, vs=vs, causal=causal):
            return A90.flash_attention_sm90(qs[i], ks[i], vs[i], causal=causal, return_lse=True)

        def mma_sync(i, qs=qs, ks=ks, vs=vs, causal=causal):
            return ck.flash_attention(qs[i], ks[i], vs[i], causal=causal, return_lse=True)

        fw = [ck.flash_attention(qs[i], ks[i], vs[i], causal=causal, return_lse=True) for i in range(k_)]

        def ours_b(i, qs=qs, ks=ks, vs=vs, dos=dos, fw=fw, causal=causal):
            return A90.flash_attention_backward_sm90(dos[i], qs[i], ks[i], vs[i], fw[i][0], fw[i][1], causal=causal)

        def mma_b(i, qs=qs, ks=ks, vs=vs, dos=dos, fw=fw, causal=causal):
            return ck.flash_attention_backward(dos[i], qs[i], ks[i], vs[i], fw[i][0], fw[i][1], causal=causal)

        def ours_fb(i, qs=qs, ks=ks, vs=vs, dos=dos, causal=causal):
            o, lse = A90.flash_attention_sm90(qs[i], ks[i], vs[i], causal=causal, return_lse=True)
            return A90.flash_attention_backward_sm90(dos[i], qs[i], ks[i], vs[i], o, lse, causal=causal)

        def mma_fb(i, qs=qs, ks=ks, vs=vs, dos=dos, causal=causal):
            o, lse = ck.flash_attention(qs[i], ks[i], vs[i], causal=causal, return_lse=True)
            return ck.flash_attention_backward(dos[i], qs[i], ks[i], vs[i], o, lse, causal=causal)

        tf = tfb = None
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
        out.append(Case("flash_attention_sm90 fwd", shape, "bf16", per_set, "q,k,v,o once", ours, mma_sync, tf,
                        note="x cupy = mma.sync fwd", extra=dict(nsets=k_, scale=1 / math.sqrt(D)), flops=f_fwd))
        for var in A90.VARIANTS:  # the other forward variants (the production one is the row above)
            if var == A90.fwd_variant(D, seq_k=T, causal=causal) or A90.fwd_variant(D, var) != var:
                continue

            def other(i, qs=qs, ks=ks, vs=vs, causal=causal, var=var):
                with ck.settings(attention_sm90_variant=var):
                    return A90.flash_attention_sm90(qs[i], ks[i], vs[i], causal=causal, return_lse=True)

            out.append(Case(f"flash_attention_sm90 fwd {var.strip('_') or 'pingpong'}", shape, "bf16", per_set,
                            "q,k,v,o once", other, mma_sync, tf, note=f"the {var or 'ping-pong'} consumer loop",
                            extra=dict(nsets=k_), flops=f_fwd))
        out.append(Case("flash_attention_sm90 bwd", shape, "bf16", 2 * per_set, "q,k,v,o,dO,dq,dk,dv once", ours_b,
                        mma_b, None, note="x cupy = mma.sync bwd", extra=dict(nsets=k_), flops=2.5 * f_fwd))
        out.append(Case("flash_attention_sm90 fwd+bwd", shape, "bf16", 3 * per_set, "fwd + bwd (wgmma)", ours_fb,
                        mma_fb, tfb, note="x cupy = mma.sync fwd+bwd", extra=dict(nsets=k_), flops=3.5 * f_fwd))
    if not ctx.quick:
        out += window_cases(ctx, "flash_attention_sm90", _fwd, _bwd, shapes=WINDOWED)
    return out


def _fwd(q, k, v, window):
    from cukernels.ops import attention_sm90 as A90

    return A90.flash_attention_sm90(q, k, v, causal=True, window=window, return_lse=True)


def _bwd(do, q, k, v, o, lse, window):
    from cukernels.ops import attention_sm90 as A90

    return A90.flash_attention_backward_sm90(do, q, k, v, o, lse, causal=True, window=window)
