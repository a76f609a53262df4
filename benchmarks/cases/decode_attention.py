"""Benchmark cases for decode_attention (kernels_cu/decode_attention.cu): one new token per sequence against a
static bf16 KV cache -- the session-5 decode step's shape (B1, max_len 384 = a 128-token prompt + 256 new, at
cache_len 128 and 384), max_len 2304 (a 2048-token prompt + 256 new) at cache_len 128 and 2048, B 1 / 8 / 64.
One launch: split partials and the last-block combine (no combine kernel since session 5). The "splits=N" rows
at B1 len384/384 force the split count (1: no combine; 2, 3) against the model's choice (the unmarked row),
the A/B that calibrates decode_attention.py's split-count model (NOTES "Decode attention in one kernel").

Memory-bound: the bytes are the valid K and V rows read once, 2 * B * cache_len * Hkv * D * 2, plus q and o
(B * H * D * 2 each); with a sliding window W only the window's rows, 2 * B * min(cache_len, W) * Hkv * D * 2.

Sliding windows (issue 37: Mistral, Qwen's "sliding_attention" layers): B1 / B8, 32 / 8 heads, D 128 (Mistral-7B's
attention), a full 32768-row cache with W = 4096 against no window ("w4096" rows): the split plan divides the
window, so the windowed row reads 1/8 of the bytes (NOTES.md "decode_attention": the prediction). Their "x torch"
runs SDPA on the window's slice of the cache, [cache_len - W, cache_len) -- what a sliding-window cache holds --
and "x cupy" the composite on that slice. "x cupy": the materialised path on the same cache slice (grouped GEMM, softmax, GEMM in
CuPy); "x torch": PyTorch's scaled_dot_product_attention on the [:cache_len] slice (what a static-cache
decode step runs). The length lives on the device, as in a captured decode step. The B1 rows' K/V (0.26-4.2 MB
a set, at most 8 sets) stay in the 60 MB L2 between calls: an L2 figure, where the decode step reads DRAM.

rope_kv_write (one token per sequence, LLaMA-3.2-1B heads 32/8 x 64, positions on the device): bytes are qkv
read once, q written, k and v rows written, the cos/sin rows read (B * D * 4); "x cupy" is the path it
replaces: contiguous copies of the packed q and k views, ck.rope on each, ck.kv_cache_write of k and of v.

decode_attention_rope (session 6: rope_kv_write + decode_attention in one launch, B1 LLaMA-3.2-1B heads at
max_len 384, cache_len 128 and 384, positions and the all-ones key_mask on the device as the fused step passes
them): bytes are the K/V rows read + qkv + o; "x cupy" is the composition it replaces (rope_kv_write, then
decode_attention: two launches). The "pdl" rows run both back to back under _launch.pdl_scope(), where the
fused kernel loads the length, mask, cos / sin and the cached K/V before pdl_wait (overlapping the previous
call; safe here: no call writes what the next reads before its wait, the appended row is never read from the
cache). The decode step's own number (after the qkv GEMV) comes from bench_generate / dev/gemv_chain.py.
"""
import math

import cukernels as ck
from bench_ops import Case
from cukernels.ops.decode_attention import _splits
from cukernels.ops import _launch
from cukernels.ops.decode_attention import (decode_attention, decode_attention_rope, decode_attention_workspace,
                                             rope_kv_write)

L_MAX = 2304
# (batch, cache_len, max_len, H, Hkv, D, forced splits or None[, window])
STEP = [(1, 128, 384, 32, 8, 64, None), (1, 384, 384, 32, 8, 64, None)] + \
       [(1, 384, 384, 32, 8, 64, s) for s in (1, 2, 3)]
SHAPES = STEP + [(B, L, L_MAX, H, Hkv, 64, None) for (H, Hkv) in ((32, 8), (12, 12)) for B in (1, 8, 64)
                 for L in (128, 2048)]
WINDOW_SHAPES = [(B, 32768, 32768, 32, 8, 128, None, W) for B in (1, 8) for W in (None, 4096)]
QUICK = STEP + [s for s in SHAPES[len(STEP):] if s[0] == 8 or (s[0] == 1 and s[3:5] == (32, 8))] + WINDOW_SHAPES[:2]
SHAPES = SHAPES + WINDOW_SHAPES


def cases(ctx):
    cp, torch = ctx.cp, ctx.torch
    out = []
    shapes = WINDOW_SHAPES if ctx.group == "window" else QUICK if ctx.quick else SHAPES  # (--group window)
    for Bsz, L, Lmax, H, Hkv, D, forced, *win in shapes:
        W = win[0] if win else None
        lo = 0 if W is None else max(0, L - W)  # the rows the one new token sees: [lo, L)
        G = H // Hkv
        r = lambda *s: cp.random.standard_normal(s, dtype=cp.float32).astype(ck.bfloat16)  # noqa: E731
        k_ = ctx.nsets(2 * Bsz * (L - lo) * Hkv * D * 2)
        qs = [r(Bsz, 1, H, D) for _ in range(k_)]
        kc = [r(Bsz, Lmax, Hkv, D) for _ in range(k_)]
        vc = [r(Bsz, Lmax, Hkv, D) for _ in range(k_)]
        length = cp.array(L, dtype=cp.int32)
        ws = decode_attention_workspace(qs[0], kc[0], num_splits=forced, window=W)
        os_ = [cp.empty_like(q) for q in qs]
        scale = 1.0 / math.sqrt(D)
        splits = _splits(Bsz, Hkv, D, Lmax, G, 1, None, forced, W)

        def ours(i, qs=qs, kc=kc, vc=vc, length=length, ws=ws, os_=os_, forced=forced, W=W):
            return decode_attention(qs[i], kc[i], vc[i], length, out=os_[i], workspace=ws, num_splits=forced,
                                    window=W)

        def comp(i, qs=qs, kc=kc, vc=vc, Bsz=Bsz, L=L, lo=lo, H=H, Hkv=Hkv, G=G, D=D, scale=scale):
            q = qs[i].reshape(Bsz, Hkv, G, D).astype(cp.float32)
            k = kc[i][:, lo:L].transpose(0, 2, 3, 1).astype(cp.float32)  # [B, Hkv, D, L - lo]
            v = vc[i][:, lo:L].transpose(0, 2, 1, 3).astype(cp.float32)  # [B, Hkv, L - lo, D]
            s = cp.matmul(q, k) * scale
            p = cp.exp(s - s.max(-1, keepdims=True))
            return (cp.matmul(p / p.sum(-1, keepdims=True), v)).astype(ck.bfloat16)

        tf = None
        if torch is not None and forced is None:
            import torch.nn.functional as Fn

            tq = [ctx.t(q).transpose(1, 2) for q in qs]                    # [B, H, 1, D]
            tk = [ctx.t(k)[:, lo:L].transpose(1, 2) for k in kc]           # [B, Hkv, L - lo, D] views
            tv = [ctx.t(v)[:, lo:L].transpose(1, 2) for v in vc]

            def tf(i, tq=tq, tk=tk, tv=tv):
                with torch.no_grad():
                    return Fn.scaled_dot_product_attention(tq[i], tk[i], tv[i], enable_gqa=True)

        nbytes = 2 * Bsz * (L - lo) * Hkv * D * 2 + 2 * Bsz * H * D * 2
        n = L - lo  # keys scanned: the window's with one
        live = -(-n // (-(-(-(-n // splits)) // 64) * 64)) if n else 1  # splits holding keys at this length
        note = f"{'forced ' if forced else ''}splits={splits} ({live} live), one launch"
        if W is not None:
            note += f"; window {W}: rows [{lo}, {L}) read"
        out.append(Case("decode_attention", f"B{Bsz} len{L}/{Lmax} {H}/{Hkv}x{D}" + (f" s{forced}" if forced else "")
                        + (f" w{W}" if W is not None else ""),
                        "bf16", nbytes, "2*B*min(len,W)*Hkv*D*2 + q,o", ours, comp if forced is None else None, tf,
                        note=note, extra=dict(nsets=k_)))
    out += _rope_kv_cases(ctx)
    out += _fused_cases(ctx)
    return out


def _rope_kv_cases(ctx):
    cp = ctx.cp
    out = []
    H, Hkv, D = 32, 8, 64
    cos, sin = ck.rope_cache(L_MAX, D)
    for Bsz in ((8,) if ctx.quick else (1, 8, 64)):
        qkv = cp.random.standard_normal((Bsz, 1, (H + 2 * Hkv) * D), dtype=cp.float32).astype(ck.bfloat16)
        kc = cp.zeros((Bsz, L_MAX, Hkv, D), dtype=ck.bfloat16)
        vc = cp.zeros_like(kc)
        length = cp.array(2048, dtype=cp.int32)
        pos = cp.array([2047], dtype=cp.int32)
        q = cp.empty((Bsz, 1, H, D), dtype=ck.bfloat16)

        def ours(i, qkv=qkv, kc=kc, vc=vc, length=length, pos=pos, q=q):
            return rope_kv_write(qkv, H, Hkv, kc, vc, length, cos=cos, sin=sin, positions=pos, q_out=q)

        def comp(i, qkv=qkv, kc=kc, vc=vc, length=length, pos=pos, Bsz=Bsz):
            qq = cp.ascontiguousarray(qkv[..., :H * D]).reshape(Bsz, 1, H, D)
            kk = cp.ascontiguousarray(qkv[..., H * D:(H + Hkv) * D]).reshape(Bsz, 1, Hkv, D)
            ck.rope(qq, cos, sin, positions=pos, out=qq)
            ck.rope(kk, cos, sin, positions=pos, out=kk)
            ck.kv_cache_write(kk, kc, length)
            ck.kv_cache_write(qkv[..., (H + Hkv) * D:].reshape(Bsz, 1, Hkv, D), vc, length)
            return qq

        nbytes = Bsz * ((H + 2 * Hkv) * D * 2 * 2 + D * 4)
        out.append(Case("rope_kv_write", f"B{Bsz} T1 {H}/{Hkv}x{D}", "bf16", nbytes,
                        "B*(H+2Hkv)*D*2*2 + B*D*4", ours, comp, None, note="replaces 2 copies + 2 rope + 2 kv writes"))
    return out


def _fused_cases(ctx):
    cp = ctx.cp
    out = []
    Bsz, H, Hkv, D, Lmax = 1, 32, 8, 64, 384
    C = (H + 2 * Hkv) * D
    cos, sin = ck.rope_cache(Lmax, D)
    for L in ((384,) if ctx.quick else (128, 384)):
        k_ = ctx.nsets(2 * Bsz * L * Hkv * D * 2)
        r = lambda *s: cp.random.standard_normal(s, dtype=cp.float32).astype(ck.bfloat16)  # noqa: E731
        qkvs = [r(Bsz, 1, C) for _ in range(k_)]
        kc = [r(Bsz, Lmax, Hkv, D) for _ in range(k_)]
        vc = [r(Bsz, Lmax, Hkv, D) for _ in range(k_)]
        length = cp.array(L, dtype=cp.int32)
        pos = cp.full((Bsz, 1), L - 1, dtype=cp.int32)
        mask = cp.ones((Bsz, Lmax), dtype=cp.bool_)
        q_like = cp.empty((Bsz, 1, H, D), dtype=ck.bfloat16)
        ws = decode_attention_workspace(q_like, kc[0], key_mask=mask)
        os_ = [cp.empty_like(q_like) for _ in range(k_)]
        qs = [cp.empty_like(q_like) for _ in range(k_)]
        splits = _splits(Bsz, Hkv, D, Lmax, H // Hkv, 1, mask, None)
        rot = dict(cos=cos, sin=sin, positions=pos)
        for pdl in (False, True):
            scope = _launch.pdl_scope if pdl else _nullscope

            def ours(i, qkvs=qkvs, kc=kc, vc=vc, length=length, rot=rot, mask=mask, ws=ws, os_=os_, scope=scope):
                with scope():
                    return decode_attention_rope(qkvs[i], H, Hkv, kc[i], vc[i], length, **rot, key_mask=mask,
                                                 out=os_[i], workspace=ws)

            def comp(i, qkvs=qkvs, kc=kc, vc=vc, length=length, rot=rot, mask=mask, ws=ws, os_=os_, qs=qs,
                     scope=scope):
                with scope():
                    q = rope_kv_write(qkvs[i], H, Hkv, kc[i], vc[i], length, **rot, q_out=qs[i])
                    return decode_attention(q, kc[i], vc[i], length, key_mask=mask, out=os_[i], workspace=ws)

            nbytes = 2 * Bsz * L * Hkv * D * 2 + Bsz * (C + H * D) * 2
            out.append(Case("decode_attention_rope", f"B{Bsz} len{L}/{Lmax} {H}/{Hkv}x{D}" + (" pdl" if pdl else ""),
                            "bf16", nbytes, "2*B*len*Hkv*D*2 + qkv,o", ours, comp, None,
                            note=f"splits={splits}; x cupy = rope_kv_write + decode_attention"
                                 + (" (both under PDL)" if pdl else ""), extra=dict(nsets=k_)))
    return out


def _nullscope():
    import contextlib

    return contextlib.nullcontext()
