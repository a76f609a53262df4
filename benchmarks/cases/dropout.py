"""Benchmark cases for dropout / dropout_backward / dropout_add (kernels_cu/dropout.cu).

Shapes: GPT-2 124M's activations at B8 x T1024 (8192 x 768) and a 2048 x 8192 MLP-sized tensor; p = 0.1 (GPT-2's
resid/attn/embd pdrop). Our rows read the offset from a 0-d device array (the graph-captured training setting).
Bytes are ours (no mask anywhere): PyTorch's native_dropout also writes a 1-byte mask in the forward and reads
it in the backward, so it moves 2s+1 (fwd, bwd) or 3s+1 (dropout + add) bytes per element.
"""
import numpy as np

import cukernels as ck
from bench_ops import Case
from cukernels.ops.dropout import dropout, dropout_add, dropout_backward

SHAPES = [(8192, 768), (2048, 8192)]
P = 0.1
SEED = 1234


def cases(ctx):
    cp, torch = ctx.cp, ctx.torch
    F_ = torch.nn.functional if torch is not None else None
    f32 = cp.float32
    scale = 1.0 / (1.0 - P)
    off = cp.zeros((), cp.uint64)
    out = []
    shapes = SHAPES[:1] if ctx.quick else SHAPES
    for dt, dn in ((ck.bfloat16, "bf16"), (np.float32, "f32")):
        for T, C in shapes:
            sz = np.dtype(dt).itemsize
            n = T * C
            k = ctx.nsets(3 * n * sz)
            rnd = lambda: cp.random.standard_normal((T, C), dtype=f32).astype(dt)  # noqa: E731
            xs, rs, dys = [rnd() for _ in range(k)], [rnd() for _ in range(k)], [rnd() for _ in range(k)]
            ys, dxs = [cp.empty_like(x) for x in xs], [cp.empty_like(x) for x in xs]
            masks = [cp.random.random((T, C), dtype=f32) >= P for _ in range(k)]  # the composite backward's mask

            def c_fwd(i, xs=xs, dt=dt, T=T, C=C):
                keep = cp.random.random((T, C), dtype=f32) >= P
                return (xs[i].astype(f32) * (keep * f32(scale))).astype(dt)

            def c_bwd(i, dys=dys, masks=masks, dt=dt):
                return (dys[i].astype(f32) * (masks[i] * f32(scale))).astype(dt)

            def c_add(i, xs=xs, rs=rs, dt=dt, T=T, C=C):
                keep = cp.random.random((T, C), dtype=f32) >= P
                return (rs[i].astype(f32) + xs[i].astype(f32) * (keep * f32(scale))).astype(dt)

            t_fwd = t_bwd = t_add = None
            if torch is not None:
                tx, tr, tdy = [ctx.t(a) for a in xs], [ctx.t(a) for a in rs], [ctx.t(a) for a in dys]
                tmask = [torch.ops.aten.native_dropout(t, P, True)[1] for t in tx]

                def t_fwd(i, tx=tx):
                    return F_.dropout(tx[i], P, training=True)

                def t_bwd(i, tdy=tdy, tmask=tmask):
                    return torch.ops.aten.native_dropout_backward(tdy[i], tmask[i], scale)

                def t_add(i, tx=tx, tr=tr):
                    return tr[i] + F_.dropout(tx[i], P, training=True)

            shape = f"{T}x{C}"
            ex = dict(nsets=k)
            out += [
                Case("dropout fwd", shape, dn, 2 * n * sz, "2*N*s",
                     lambda i, xs=xs, ys=ys: dropout(xs[i], P, seed=SEED, offset=off, out=ys[i]), c_fwd, t_fwd,
                     note="torch: +1 B/el mask", extra=ex),
                Case("dropout bwd", shape, dn, 2 * n * sz, "2*N*s (mask regenerated)",
                     lambda i, dys=dys, dxs=dxs: dropout_backward(dys[i], P, seed=SEED, offset=off, out=dxs[i]),
                     c_bwd, t_bwd, note="torch, cupy: read a 1 B/el mask", extra=ex),
                Case("dropout_add", shape, dn, 3 * n * sz, "3*N*s",
                     lambda i, xs=xs, rs=rs, ys=ys: dropout_add(xs[i], rs[i], P, seed=SEED, offset=off, out=ys[i]),
                     c_add, t_add, note="torch: dropout + add, 2 kernels", extra=ex),
            ]

    # GPT-2 under bf16 autocast: the fp32 residual stream += dropout(bf16 branch output), in place.
    T, C = SHAPES[0]
    n = T * C
    k = ctx.nsets(10 * n)
    xb = [cp.random.standard_normal((T, C), dtype=f32).astype(ck.bfloat16) for _ in range(k)]
    hs = [cp.random.standard_normal((T, C), dtype=f32) for _ in range(k)]

    def c_mixed(i):
        keep = cp.random.random((T, C), dtype=f32) >= P
        return cp.add(hs[i], xb[i].astype(f32) * (keep * f32(scale)), out=hs[i])

    t_mixed = None
    if torch is not None:
        txb, th = [ctx.t(a) for a in xb], [ctx.t(a) for a in hs]

        def t_mixed(i):
            return th[i].add_(F_.dropout(txb[i], P, training=True))

    out.append(Case("dropout_add fp32 += bf16 (in place)", f"{T}x{C}", "mixed", 10 * n, "(2+4+4)*N",
                    lambda i: dropout_add(xb[i], hs[i], P, seed=SEED, offset=off, out=hs[i]), c_mixed, t_mixed,
                    note="GPT-2 residual under autocast", extra=dict(nsets=k)))

    # ... and its backward: the fp32 residual gradient through the branch's dropout, to a bf16 dx.
    k = ctx.nsets(6 * n)
    dys = [cp.random.standard_normal((T, C), dtype=f32) for _ in range(k)]
    dxs = [cp.empty((T, C), dtype=ck.bfloat16) for _ in range(k)]
    masks = [cp.random.random((T, C), dtype=f32) >= P for _ in range(k)]

    def c_mixed_bwd(i):
        return (dys[i] * (masks[i] * f32(scale))).astype(ck.bfloat16)

    t_mixed_bwd = None
    if torch is not None:
        tdy = [ctx.t(a) for a in dys]
        tmask = [torch.rand(T, C, device="cuda") >= P for _ in range(k)]

        def t_mixed_bwd(i):
            return torch.ops.aten.native_dropout_backward(tdy[i], tmask[i], scale).to(torch.bfloat16)

    out.append(Case("dropout bwd fp32 dy -> bf16 dx", f"{T}x{C}", "mixed", 6 * n, "(4+2)*N",
                    lambda i: dropout_backward(dys[i], P, seed=SEED, offset=off, out=dxs[i]), c_mixed_bwd,
                    t_mixed_bwd, note="GPT-2 residual backward", extra=dict(nsets=k)))
    return out
