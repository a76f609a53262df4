"""Benchmark cases for ck.layer_norm / ck.layer_norm_backward (kernels_cu/layer_norm.cu)."""
import numpy as np

import cukernels as ck
from bench_ops import Case

# The target shape first; then the column sweep (1, 128, 1000, 4096, 32768) at ~2^26 elements.
SHAPES = [(8192, 2048), (8192, 768), (1 << 22, 1), (1 << 19, 128), (65536, 1000), (16384, 4096), (2048, 32768)]


def cases(ctx):
    cp, torch = ctx.cp, ctx.torch
    out = []
    shapes = SHAPES[:2] if ctx.quick else SHAPES  # (8192 x 768: GPT-2 124M's rows)
    for dt, dn in ((np.float32, "f32"), (ck.bfloat16, "bf16")):
        for N, C in shapes:
            sz = np.dtype(dt).itemsize
            k = ctx.nsets(3 * N * C * sz)
            xs = [cp.random.standard_normal((N, C), dtype=cp.float32).astype(dt) for _ in range(k)]
            dys = [cp.random.standard_normal((N, C), dtype=cp.float32).astype(dt) for _ in range(k)]
            g = cp.random.standard_normal(C, dtype=cp.float32).astype(dt)
            b = cp.random.standard_normal(C, dtype=cp.float32).astype(dt)
            ys = [cp.empty_like(x) for x in xs]
            stats = [ck.layer_norm(x, g, b, 1e-5, return_stats=True)[1:] for x in xs]
            dxs = [cp.empty_like(x) for x in xs]

            def comp_fwd(i, xs=xs, g=g, b=b, dt=dt):
                xf = xs[i].astype(cp.float32)
                mu = xf.mean(-1, keepdims=True)
                d = xf - mu
                r = 1 / cp.sqrt((d * d).mean(-1, keepdims=True) + 1e-5)
                return (d * r * g.astype(cp.float32) + b.astype(cp.float32)).astype(dt)

            def comp_bwd(i, xs=xs, dys=dys, g=g, stats=stats, dt=dt):
                xf, gf = xs[i].astype(cp.float32), dys[i].astype(cp.float32)
                mu, r = stats[i][0][:, None], stats[i][1][:, None]
                xh = (xf - mu) * r
                gg = gf * g.astype(cp.float32)
                dx = (r * (gg - gg.mean(-1, keepdims=True) - xh * (gg * xh).mean(-1, keepdims=True))).astype(dt)
                return dx, (gf * xh).sum(0).astype(dt), gf.sum(0).astype(dt)

            tf = tb = None
            if torch is not None:
                tx = [ctx.t(x).clone().requires_grad_(True) for x in xs]
                tg = ctx.t(g).clone().requires_grad_(True)
                tbeta = ctx.t(b).clone().requires_grad_(True)
                tdy = [ctx.t(d) for d in dys]
                F = torch.nn.functional
                ty = [F.layer_norm(t, (C,), tg, tbeta, 1e-5) for t in tx]

                def tf(i, tx=tx, tg=tg, tbeta=tbeta, C=C):
                    with torch.no_grad():
                        return F.layer_norm(tx[i], (C,), tg, tbeta, 1e-5)

                def tb(i, tx=tx, tg=tg, tbeta=tbeta, ty=ty, tdy=tdy):
                    return torch.autograd.grad(ty[i], (tx[i], tg, tbeta), tdy[i], retain_graph=True)

            shape = f"{N}x{C}"
            out.append(Case("layer_norm fwd (+mean,rstd)", shape, dn, 2 * N * C * sz + 2 * C * sz + 8 * N,
                            "2*N*C*s + 2*C*s + 8*N",
                            lambda i, xs=xs, g=g, b=b, ys=ys: ck.layer_norm(xs[i], g, b, 1e-5, return_stats=True, out=ys[i]),
                            comp_fwd, tf, extra=dict(nsets=k)))
            out.append(Case("layer_norm bwd (dx,dg,db)", shape, dn, 3 * N * C * sz + 3 * C * sz + 8 * N,
                            "3*N*C*s + 3*C*s + 8*N",
                            lambda i, xs=xs, g=g, dys=dys, stats=stats, dxs=dxs: ck.layer_norm_backward(
                                dys[i], xs[i], g, stats[i][0], stats[i][1], out=dxs[i]),
                            comp_bwd, tb, extra=dict(nsets=k)))
    return out
