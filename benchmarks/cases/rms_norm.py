"""Benchmark cases for ck.rms_norm / ck.rms_norm_backward (kernels_cu/rms_norm.cu)."""
import numpy as np

import cukernels as ck
from bench_ops import Case

SHAPES = [(1, 2048), (256, 2048), (8192, 2048), (4096, 4096), (8192, 8192), (2048, 32768)]


def cases(ctx):
    cp, torch = ctx.cp, ctx.torch
    out = []
    shapes = SHAPES[1:3] if ctx.quick else SHAPES
    for dt, dn in ((np.float32, "f32"), (ck.bfloat16, "bf16")):
        for N, C in shapes:
            sz = np.dtype(dt).itemsize
            k = ctx.nsets(3 * N * C * sz)
            xs = [cp.random.standard_normal((N, C), dtype=cp.float32).astype(dt) for _ in range(k)]
            dys = [cp.random.standard_normal((N, C), dtype=cp.float32).astype(dt) for _ in range(k)]
            w = cp.random.standard_normal(C, dtype=cp.float32).astype(dt)
            ys = [cp.empty_like(x) for x in xs]
            rs = [ck.rms_norm(x, w, 1e-5, return_rstd=True)[1] for x in xs]
            dxs = [cp.empty_like(x) for x in xs]

            def comp_fwd(i, xs=xs, w=w, dt=dt):
                xf = xs[i].astype(cp.float32)
                r = 1 / cp.sqrt((xf * xf).mean(-1, keepdims=True) + 1e-5)
                return (xf * r * w.astype(cp.float32)).astype(dt)

            def comp_bwd(i, xs=xs, dys=dys, w=w, rs=rs, dt=dt, C=C):
                xf, gf, r = xs[i].astype(cp.float32), dys[i].astype(cp.float32), rs[i][:, None]
                g = gf * w.astype(cp.float32)
                dx = (r * (g - xf * r * r * (g * xf).mean(-1, keepdims=True))).astype(dt)
                return dx, (gf * xf * r).sum(0).astype(dt)

            tf = tb = None
            if torch is not None:
                tx = [ctx.t(x).clone().requires_grad_(True) for x in xs]
                tw = ctx.t(w).clone().requires_grad_(True)
                tdy = [ctx.t(d) for d in dys]
                F = torch.nn.functional
                ty = [F.rms_norm(t, (C,), tw, 1e-5) for t in tx]

                def tf(i, tx=tx, tw=tw, C=C):
                    with torch.no_grad():
                        return F.rms_norm(tx[i], (C,), tw, 1e-5)

                def tb(i, tx=tx, tw=tw, ty=ty, tdy=tdy):
                    return torch.autograd.grad(ty[i], (tx[i], tw), tdy[i], retain_graph=True)

            shape = f"{N}x{C}"
            out.append(Case("rms_norm fwd", shape, dn, 2 * N * C * sz + C * sz + 4 * N, "2*N*C*s + C*s + 4*N",
                            lambda i, xs=xs, w=w, ys=ys, rs=rs: ck.rms_norm(xs[i], w, 1e-5, out=ys[i]),
                            comp_fwd, tf, extra=dict(nsets=k)))
            out.append(Case("rms_norm bwd (dx, dw)", shape, dn, 3 * N * C * sz + 2 * C * sz + 4 * N,
                            "3*N*C*s + 2*C*s + 4*N",
                            lambda i, xs=xs, w=w, dys=dys, rs=rs, dxs=dxs: ck.rms_norm_backward(dys[i], xs[i], w, rs[i], out=dxs[i]),
                            comp_bwd, tb, extra=dict(nsets=k)))
    return out
