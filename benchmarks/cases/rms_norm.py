"""Benchmark cases for ck.rms_norm / ck.rms_norm_backward and the residual-add fusion add_rms_norm /
add_rms_norm_backward (kernels_cu/rms_norm.cu)."""
import numpy as np

import cukernels as ck
from bench_ops import Case
from cukernels.ops.rms_norm import add_rms_norm, add_rms_norm_backward

# add_rms_norm: the transformer-block shapes (LLaMA-3.2-1B at 8 x 1024 tokens, GPT-2-sized width).
ADD_SHAPES = [(8192, 2048), (8192, 768), (16384, 4096)]

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
    out += add_cases(ctx)
    return out


def add_cases(ctx):
    """h = x + r, y = rms_norm(h): ours in one kernel each way vs the two-launch composite (ck.add + ck.rms_norm;
    backward ck.rms_norm_backward + ck.add) and torch (x + r, F.rms_norm; autograd of both outputs)."""
    cp, torch = ctx.cp, ctx.torch
    out = []
    shapes = ADD_SHAPES[:1] if ctx.quick else ADD_SHAPES
    for dt, dn in ((np.float32, "f32"), (ck.bfloat16, "bf16")):
        for N, C in shapes:
            sz = np.dtype(dt).itemsize
            k = ctx.nsets(4 * N * C * sz)
            mk = lambda: cp.random.standard_normal((N, C), dtype=cp.float32).astype(dt)  # noqa: E731
            xs, rs_, dys, dhs = [mk() for _ in range(k)], [mk() for _ in range(k)], [mk() for _ in range(k)], \
                [mk() for _ in range(k)]
            w = cp.random.standard_normal(C, dtype=cp.float32).astype(dt)
            ys, hs, dxs = [cp.empty_like(x) for x in xs], [cp.empty_like(x) for x in xs], [cp.empty_like(x) for x in xs]
            stats = [add_rms_norm(xs[i], rs_[i], w, 1e-5, return_rstd=True, out=ys[i], out_sum=hs[i])[2]
                     for i in range(k)]

            def comp_fwd(i, xs=xs, rs_=rs_, w=w, hs=hs, ys=ys):
                ck.add(xs[i], rs_[i], out=hs[i])
                return ck.rms_norm(hs[i], w, 1e-5, out=ys[i])

            def comp_bwd(i, dys=dys, dhs=dhs, hs=hs, w=w, stats=stats, dxs=dxs):
                dx, dw = ck.rms_norm_backward(dys[i], hs[i], w, stats[i], out=dxs[i])
                return ck.add(dx, dhs[i], out=dx), dw

            tf = tb = None
            if torch is not None:
                F = torch.nn.functional
                tx = [ctx.t(x).clone().requires_grad_(True) for x in xs]
                tr = [ctx.t(r).clone().requires_grad_(True) for r in rs_]
                tw = ctx.t(w).clone().requires_grad_(True)
                th = [a + b for a, b in zip(tx, tr)]
                ty = [F.rms_norm(h, (C,), tw, 1e-5) for h in th]
                tdy, tdh = [ctx.t(d) for d in dys], [ctx.t(d) for d in dhs]

                def tf(i, tx=tx, tr=tr, tw=tw, C=C):
                    with torch.no_grad():
                        h = tx[i] + tr[i]
                        return F.rms_norm(h, (C,), tw, 1e-5), h

                def tb(i, tx=tx, tw=tw, th=th, ty=ty, tdy=tdy, tdh=tdh):
                    return torch.autograd.grad((ty[i], th[i]), (tx[i], tw), (tdy[i], tdh[i]), retain_graph=True)

            shape = f"{N}x{C}"
            out.append(Case("add_rms_norm fwd (y, h)", shape, dn, 4 * N * C * sz + C * sz + 4 * N,
                            "4*N*C*s + C*s + 4*N",
                            lambda i, xs=xs, rs_=rs_, w=w, ys=ys, hs=hs: add_rms_norm(
                                xs[i], rs_[i], w, 1e-5, out=ys[i], out_sum=hs[i]),
                            comp_fwd, tf, extra=dict(nsets=k)))
            out.append(Case("add_rms_norm bwd (dx+dh, dw)", shape, dn, 4 * N * C * sz + 2 * C * sz + 4 * N,
                            "4*N*C*s + 2*C*s + 4*N",
                            lambda i, dys=dys, dhs=dhs, hs=hs, w=w, stats=stats, dxs=dxs: add_rms_norm_backward(
                                dys[i], dhs[i], hs[i], w, stats[i], out=dxs[i]),
                            comp_bwd, tb, extra=dict(nsets=k)))
    return out
