"""Benchmark cases for ck.flash_attention / ck.flash_attention_backward (kernels_cu/attention.cu).

Compute-bound: the row's TFLOP/s counts the model FLOPs (4 B H Tq Tk D forward, halved under the causal mask;
backward 2.5x forward), not the recomputation. "x cupy" is the materialised path the model used before
(ck.matmul -> ck.attn_softmax -> ck.matmul, grouped-query layout), "x torch" PyTorch's
scaled_dot_product_attention (its flash backend) on the same [B, T, H, D] views.

Key-padding rows ("pad25%L"): the same inputs with a Hugging Face style left-padding attention_mask (int64
[B, T], row b padded by round(T/2 * b/(B-1)) keys: 0 .. T/2, 25 % of all keys), through the *_km kernels. Their
TFLOP/s use the unmasked causal count (so the column compares times); the padding removes 37 % of the causal
tile pairs at B8 x T1024 (benchmarks/NOTES.md). "x torch" there is what transformers' sdpa path runs: K/V heads
repeated, one [B, 1, T, T] boolean mask (causal and padding) -> SDPA's memory-efficient kernel.

Sliding-window rows ("w4096", WINDOWED: Mistral-7B's heads and window at 8192 tokens): the mma.sync kernels
(attention_wgmma off, so the rows mean the same on Hopper), each once without the window and once with it. The
windowed rows' TFLOP/s count the pairs the window leaves (4 B H D * window_pairs), their "x cupy" is the same call
without the window (the gain of skipping tiles; the tile model predicts 1 / 0.756 = 1.32x), their "x torch"
PyTorch's FlexAttention (torch.compile'd, a causal sliding-window block mask, GQA): its fastest documented
sliding-window path (SDPA has none; transformers' sdpa runs the window as a dense [B, 1, T, T] mask).
"""
import math

import cukernels as ck
from bench_ops import Case

# (B, T, H, Hkv, D, causal): LLaMA-3.2-1B at the B8 x T1024 training shape, a long sequence, 128-wide heads.
SHAPES = [(8, 1024, 32, 8, 64, True), (2, 4096, 32, 8, 64, True), (8, 1024, 16, 16, 128, True),
          (8, 1024, 32, 8, 64, False)]
MASKED = {(8, 1024, 32, 8, 64, True)}  # shapes that also get the left-padding rows
PAD = 0.25  # mean padded fraction of the keys
# (B, T, H, Hkv, D, window): causal rows with and without the sliding window (not in --quick)
WINDOWED = [(2, 8192, 32, 8, 128, 4096)]


def window_pairs(T, W):
    """(query, key) pairs a causal call sees at seq_q = seq_k = T with a sliding window W (W >= T: the causal
    T (T + 1) / 2): each query its min(i + 1, W) latest keys."""
    W = min(W, T)
    return W * (W + 1) // 2 + (T - W) * W


def window_torch(ctx, qs, ks, vs, dos, T, W):
    """PyTorch's sliding-window attention as a competent user runs it: FlexAttention compiled, with the causal
    sliding-window block mask built once (blocks outside the band skipped, as ours), GQA without repeating K / V.
    Returns (fwd, fwd+bwd) callables on the input sets, or (None, None) when FlexAttention is unavailable."""
    torch = ctx.torch
    if torch is None:
        return None, None
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def band(b, h, q_idx, kv_idx):  # Hugging Face's sliding_window_overlay on the causal mask
            return (kv_idx <= q_idx) & (q_idx - kv_idx < W)

        bm = create_block_mask(band, None, None, T, T, device="cuda")
        flex = torch.compile(flex_attention, dynamic=False)
        tq = [ctx.t(x).transpose(1, 2).requires_grad_(True) for x in qs]
        tk = [ctx.t(x).transpose(1, 2).requires_grad_(True) for x in ks]
        tv = [ctx.t(x).transpose(1, 2).requires_grad_(True) for x in vs]
        tdo = [ctx.t(x).transpose(1, 2) for x in dos]

        def tf(i):
            with torch.no_grad():
                return flex(tq[i], tk[i], tv[i], block_mask=bm, enable_gqa=True)

        def tfb(i):
            o = flex(tq[i], tk[i], tv[i], block_mask=bm, enable_gqa=True)
            return torch.autograd.grad(o, (tq[i], tk[i], tv[i]), tdo[i])

        tfb(0)  # compile both directions now (a failure leaves the torch column empty, with the reason)
        torch.cuda.synchronize()
        return tf, tfb
    except Exception as e:
        print(f"    (FlexAttention unavailable for the window rows: {type(e).__name__}: {str(e)[:160]})")
        return None, None


def window_cases(ctx, name, fwd, bwd, shapes=WINDOWED, note=""):
    """fwd / bwd / fwd+bwd rows of each (B, T, H, Hkv, D, W) in ``shapes``, causal, once without the window and
    once with it: ``fwd(q, k, v, window)`` -> (o, lse), ``bwd(do, q, k, v, o, lse, window)`` -> grads. The windowed
    rows' "x cupy" is the no-window call (what skipping the tiles outside the band gains), "x torch" FlexAttention."""
    cp = ctx.cp
    out = []
    for Bsz, T, H, Hkv, D, W in shapes:
        r = lambda *s: cp.random.standard_normal(s, dtype=cp.float32).astype(ck.bfloat16)  # noqa: E731
        per_set = (2 * Bsz * T * H * D + 2 * Bsz * T * Hkv * D) * 2
        k_ = min(ctx.nsets(per_set), 3)
        qs = [r(Bsz, T, H, D) for _ in range(k_)]
        ks = [r(Bsz, T, Hkv, D) for _ in range(k_)]
        vs = [r(Bsz, T, Hkv, D) for _ in range(k_)]
        dos = [r(Bsz, T, H, D) for _ in range(k_)]
        tf, tfb = window_torch(ctx, qs, ks, vs, dos, T, W)
        sdpa = sdpa_bwd = None
        if ctx.torch is not None:
            import torch.nn.functional as Fn

            torch = ctx.torch
            tq = [ctx.t(x).transpose(1, 2).requires_grad_(True) for x in qs]
            tk = [ctx.t(x).transpose(1, 2).requires_grad_(True) for x in ks]
            tv = [ctx.t(x).transpose(1, 2).requires_grad_(True) for x in vs]
            tdo = [ctx.t(x).transpose(1, 2) for x in dos]

            def sdpa(i, tq=tq, tk=tk, tv=tv):
                with torch.no_grad():
                    return Fn.scaled_dot_product_attention(tq[i], tk[i], tv[i], is_causal=True, enable_gqa=True)

            def sdpa_bwd(i, tq=tq, tk=tk, tv=tv, tdo=tdo):
                o = Fn.scaled_dot_product_attention(tq[i], tk[i], tv[i], is_causal=True, enable_gqa=True)
                return torch.autograd.grad(o, (tq[i], tk[i], tv[i]), tdo[i])

        calls = {}  # window -> (fwd, bwd, fwd+bwd) on input set i
        # (the inputs bound as defaults: the cases run after every shape is built, and a closure over the loop's
        # qs / ks / vs timed the last shape's inputs under an earlier shape's label)
        for win in (None, W):
            fw = [fwd(qs[i], ks[i], vs[i], win) for i in range(k_)]

            def f_(i, win=win, qs=qs, ks=ks, vs=vs):
                return fwd(qs[i], ks[i], vs[i], win)

            def b_(i, win=win, fw=fw, qs=qs, ks=ks, vs=vs, dos=dos):
                return bwd(dos[i], qs[i], ks[i], vs[i], fw[i][0], fw[i][1], win)

            def fb_(i, win=win, qs=qs, ks=ks, vs=vs, dos=dos):
                o, lse = fwd(qs[i], ks[i], vs[i], win)
                return bwd(dos[i], qs[i], ks[i], vs[i], o, lse, win)

            calls[win] = (f_, b_, fb_)
        flops = {None: 4.0 * Bsz * H * D * T * T / 2, W: 4.0 * Bsz * H * D * window_pairs(T, W)}
        peers = {None: (None, None, sdpa, sdpa_bwd), W: (*calls[None][::2], tf, tfb)}
        for win in (None, W):
            shape = f"{Bsz}x{T}x{H}/{Hkv}x{D}" + ("" if win is None else f" w{win}")
            nt = note if win is None else "x cupy = the same call without the window" + ("; " if note else "") + note
            f_, b_, fb_ = calls[win]
            base_f, base_fb, tor_f, tor_fb = peers[win]
            base_b = None if win is None else calls[None][1]
            out.append(Case(f"{name} fwd", shape, "bf16", per_set, "q,k,v,o once", f_, base_f, tor_f, note=nt,
                            extra=dict(nsets=k_), flops=flops[win]))
            out.append(Case(f"{name} bwd", shape, "bf16", 2 * per_set, "q,k,v,o,dO,dq,dk,dv once", b_, base_b, None,
                            note=nt, extra=dict(nsets=k_), flops=2.5 * flops[win]))
            out.append(Case(f"{name} fwd+bwd", shape, "bf16", 3 * per_set, "fwd + bwd", fb_, base_fb, tor_fb,
                            note=nt, extra=dict(nsets=k_), flops=3.5 * flops[win]))
    return out


def _mma_fwd(q, k, v, window):
    with ck.settings(attention_wgmma=False):
        return ck.flash_attention(q, k, v, causal=True, window=window, return_lse=True)


def _mma_bwd(do, q, k, v, o, lse, window):
    with ck.settings(attention_wgmma=False):
        return ck.flash_attention_backward(do, q, k, v, o, lse, causal=True, window=window)


def left_padding_mask(cp, Bsz, T):
    """int64 [B, T] (1 = keep): row b has round(2 * PAD * T * b / (B - 1)) leading padding positions."""
    import numpy as np

    m = np.ones((Bsz, T), np.int64)
    for b in range(Bsz):
        m[b, :round(2 * PAD * T * b / max(Bsz - 1, 1))] = 0
    return cp.asarray(m)


def cases(ctx):
    if ctx.group == "window":  # (bench_ops.py --group window)
        return window_cases(ctx, "flash_attention", _mma_fwd, _mma_bwd, note="mma.sync (attention_wgmma off)")
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
        if (Bsz, T, H, Hkv, D, causal) in MASKED:
            out += masked_cases(ctx, qs, ks, vs, dos, Bsz, T, H, Hkv, D, causal, per_set, k_, f_fwd, shape)
    if not ctx.quick:
        out += window_cases(ctx, "flash_attention", _mma_fwd, _mma_bwd, note="mma.sync (attention_wgmma off)")
    return out


def masked_cases(ctx, qs, ks, vs, dos, Bsz, T, H, Hkv, D, causal, io, k_, f_fwd, shape):
    """fwd, bwd and fwd+bwd with a left-padding key mask, on the no-mask rows' inputs."""
    cp, torch = ctx.cp, ctx.torch
    G = H // Hkv
    km = left_padding_mask(cp, Bsz, T)
    io_m = io + km.nbytes  # the mask is read once per key tile from L2; HBM sees it once
    fw = [ck.flash_attention(qs[i], ks[i], vs[i], causal=causal, key_mask=km, return_lse=True) for i in range(k_)]
    tf = tfb = None
    if torch is not None:
        import torch.nn.functional as Fn

        tq = [ctx.t(x).transpose(1, 2).requires_grad_(True) for x in qs]
        tk = [ctx.t(x).transpose(1, 2).requires_grad_(True) for x in ks]
        tv = [ctx.t(x).transpose(1, 2).requires_grad_(True) for x in vs]
        tdo = [ctx.t(x).transpose(1, 2) for x in dos]
        keep = ctx.t(km).bool()
        vis = torch.ones(T, T, dtype=torch.bool, device=keep.device)
        vis = torch.tril(vis) if causal else vis
        mask4 = (vis[None, None] & keep[:, None, None, :]).contiguous()  # [B, 1, T, T], built once

        def hf_sdpa(i):
            kk, vv = tk[i].repeat_interleave(G, dim=1), tv[i].repeat_interleave(G, dim=1)
            return Fn.scaled_dot_product_attention(tq[i], kk, vv, attn_mask=mask4)

        def tf(i):
            with torch.no_grad():
                return hf_sdpa(i)

        def tfb(i):
            return torch.autograd.grad(hf_sdpa(i), (tq[i], tk[i], tv[i]), tdo[i])

    def ours_fb(i):
        o, lse = ck.flash_attention(qs[i], ks[i], vs[i], causal=causal, key_mask=km, return_lse=True)
        return ck.flash_attention_backward(dos[i], qs[i], ks[i], vs[i], o, lse, causal=causal, key_mask=km)

    shape_m = shape + f" pad{round(100 * PAD)}%L"
    return [
        Case("flash_attention fwd", shape_m, "bf16", io_m, "q,k,v,o once + mask",
             lambda i: ck.flash_attention(qs[i], ks[i], vs[i], causal=causal, key_mask=km, return_lse=True),
             None, tf, extra=dict(nsets=k_), flops=f_fwd),
        Case("flash_attention bwd", shape_m, "bf16", 2 * io_m, "q,k,v,o,dO,dq,dk,dv once + mask",
             lambda i: ck.flash_attention_backward(dos[i], qs[i], ks[i], vs[i], fw[i][0], fw[i][1], causal=causal,
                                                   key_mask=km),
             None, None, extra=dict(nsets=k_), flops=2.5 * f_fwd),
        Case("flash_attention fwd+bwd", shape_m, "bf16", 3 * io_m, "fwd + bwd + mask", ours_fb, None, tfb,
             extra=dict(nsets=k_), flops=3.5 * f_fwd),
    ]
