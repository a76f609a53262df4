"""Benchmark cases for ck.rope / ck.rope_backward (kernels_cu/rope.cu)."""
import numpy as np

import cukernels as ck
from bench_ops import Case

LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
# [batch, seq, heads, head_dim]: LLaMA-3.2-1B queries (32 x 64) at two token counts, and a 128-wide head.
SHAPES = [(8, 2048, 32, 64), (16, 4096, 32, 64), (8, 4096, 32, 128)]


def cases(ctx):
    cp, torch = ctx.cp, ctx.torch
    out = []
    shapes = SHAPES[:1] if ctx.quick else SHAPES
    for dt, dn in ((ck.bfloat16, "bf16"), (np.float32, "f32")):
        for Bsz, S, H, D in shapes:
            sz = np.dtype(dt).itemsize
            n = Bsz * S * H * D
            if dn == "f32" and n > 2**28:
                continue
            k = ctx.nsets(2 * n * sz)
            xs = [cp.random.standard_normal((Bsz, S, H, D), dtype=cp.float32).astype(dt) for _ in range(k)]
            ys = [cp.empty_like(x) for x in xs]
            cos, sin = ck.rope_cache(S, D, 500000.0, LLAMA3, xp=cp)
            half = D // 2
            cosf = cp.concatenate([cos, cos], -1)[None, :, None, :]
            sinf = cp.concatenate([sin, sin], -1)[None, :, None, :]

            def comp(i, xs=xs, cosf=cosf, sinf=sinf, half=half, dt=dt, sgn=1.0):
                xf = xs[i].astype(cp.float32)
                rot = cp.concatenate([-xf[..., half:], xf[..., :half]], -1)
                return (xf * cosf + rot * (sgn * sinf)).astype(dt)

            tf = None
            if torch is not None:
                tx = [ctx.t(x) for x in xs]
                tcos = torch.cat([ctx.t(cos), ctx.t(cos)], -1).to(tx[0].dtype)[None, :, None, :]
                tsin = torch.cat([ctx.t(sin), ctx.t(sin)], -1).to(tx[0].dtype)[None, :, None, :]

                def tf(i, tx=tx, tcos=tcos, tsin=tsin, half=half):  # HF apply_rotary_pos_emb
                    q = tx[i]
                    return q * tcos + torch.cat((-q[..., half:], q[..., :half]), -1) * tsin

            shape = f"{Bsz}x{S}x{H}x{D}"
            nbytes = 2 * n * sz + 2 * S * half * 4
            for il in (False, True):
                out.append(Case("rope fwd" + (" interleaved" if il else ""), shape, dn, nbytes, "2*N*s + 2*S*D/2*4",
                                lambda i, xs=xs, ys=ys, cos=cos, sin=sin, il=il: ck.rope(xs[i], cos, sin, interleaved=il, out=ys[i]),
                                None if il else comp, None if il else tf, extra=dict(nsets=k)))
            out.append(Case("rope bwd", shape, dn, nbytes, "2*N*s + 2*S*D/2*4",
                            lambda i, xs=xs, ys=ys, cos=cos, sin=sin: ck.rope_backward(xs[i], cos, sin, out=ys[i]),
                            lambda i, comp=comp: comp(i, sgn=-1.0), None, extra=dict(nsets=k)))
            out.append(Case("rope fwd in place", shape, dn, nbytes, "2*N*s + 2*S*D/2*4",
                            lambda i, xs=xs, cos=cos, sin=sin: ck.rope(xs[i], cos, sin, out=xs[i]),
                            None, None, extra=dict(nsets=k)))
    out += _packed_cases(ctx)
    return out


def _packed_cases(ctx):
    """The model's call: q and k heads of a packed qkv projection rotated in place by one launch (LLaMA-3.2-1B,
    B8 x T1024, heads 32 / 8 x 64 of 48 a token; session 15's profile: 0.53 ms a step at ~60 % of copy)."""
    cp = ctx.cp
    Bsz, S, H, Hkv, D = 8, 1024, 32, 8, 64
    n = Bsz * S * (H + Hkv) * D
    k = ctx.nsets(2 * n * 2)
    qkvs = [cp.random.standard_normal((Bsz, S, H + 2 * Hkv, D), dtype=cp.float32).astype(ck.bfloat16) for _ in range(k)]
    cos, sin = ck.rope_cache(S, D, 500000.0, LLAMA3, xp=cp)
    nbytes = 2 * n * 2 + 2 * S * (D // 2) * 4
    return [Case("rope fwd packed qk in place", f"{Bsz}x{S}x({H}+{Hkv})/{H + 2 * Hkv}x{D}", "bf16", nbytes,
                 "2*N*s + 2*S*D/2*4",
                 lambda i: ck.rope(qkvs[i][:, :, :H + Hkv], cos, sin, out=qkvs[i][:, :, :H + Hkv]),
                 None, None, extra=dict(nsets=k))]
