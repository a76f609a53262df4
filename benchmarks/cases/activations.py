"""Benchmark cases for ck.swiglu / ck.swiglu_packed / ck.gelu (tanh and exact erf forms) and their backwards
(kernels_cu/activations.cu)."""
import numpy as np

import cukernels as ck
from bench_ops import Case

# [tokens, ffn]: LLaMA-3.2-1B's MLP (ffn 8192) at 4k and 16k tokens.
SHAPES = [(4096, 8192), (16384, 8192)]


def cases(ctx):
    cp, torch = ctx.cp, ctx.torch
    from cupyx.scipy.special import erf  # the CuPy composite's erf (an elementwise kernel)
    F_ = torch.nn.functional if torch is not None else None
    out = []
    shapes = SHAPES[:1] if ctx.quick else SHAPES
    for dt, dn in ((ck.bfloat16, "bf16"), (np.float32, "f32")):
        for T, F in shapes:
            sz = np.dtype(dt).itemsize
            n = T * F
            if dn == "f32" and n > 2**26:
                T = 2**26 // F
                n = T * F
            k = ctx.nsets(5 * n * sz)
            rnd = lambda shape: cp.random.standard_normal(shape, dtype=cp.float32).astype(dt)
            gs, us, dys = [rnd((T, F)) for _ in range(k)], [rnd((T, F)) for _ in range(k)], [rnd((T, F)) for _ in range(k)]
            gus = [rnd((T, 2 * F)) for _ in range(k)]
            ys, dgs, dus = [cp.empty_like(g) for g in gs], [cp.empty_like(g) for g in gs], [cp.empty_like(g) for g in gs]
            dgus = [cp.empty_like(g) for g in gus]
            shape = f"{T}x{F}"
            f32 = cp.float32

            def c_swiglu(i, dt=dt, gs=gs, us=us):
                g = gs[i].astype(f32)
                return (g / (1 + cp.exp(-g)) * us[i].astype(f32)).astype(dt)

            def c_swiglu_bwd(i, dt=dt, gs=gs, us=us, dys=dys):
                g, u, d = gs[i].astype(f32), us[i].astype(f32), dys[i].astype(f32)
                s = 1 / (1 + cp.exp(-g))
                return (d * u * s * (1 + g * (1 - s))).astype(dt), (d * g * s).astype(dt)

            def c_packed(i, dt=dt, gus=gus, F=F):
                g, u = gus[i][:, :F].astype(f32), gus[i][:, F:].astype(f32)
                return (g / (1 + cp.exp(-g)) * u).astype(dt)

            def c_gelu(i, dt=dt, gs=gs):
                x = gs[i].astype(f32)
                return (0.5 * x * (1 + cp.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))).astype(dt)

            def c_gelu_bwd(i, dt=dt, gs=gs, dys=dys):
                x = gs[i].astype(f32)
                t = cp.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))
                g = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * 0.7978845608028654 * (1 + 0.134145 * x * x)
                return (dys[i].astype(f32) * g).astype(dt)

            def c_gelu_erf(i, dt=dt, gs=gs):
                x = gs[i].astype(f32)
                return (0.5 * x * (1 + erf(x * 0.7071067811865476))).astype(dt)

            def c_gelu_erf_bwd(i, dt=dt, gs=gs, dys=dys):
                x = gs[i].astype(f32)
                g = 0.5 * (1 + erf(x * 0.7071067811865476)) + x * cp.exp(-0.5 * x * x) * 0.3989422804014327
                return (dys[i].astype(f32) * g).astype(dt)

            t_sw = t_swb = t_pk = t_pkb = t_ge = t_geb = t_gee = t_geeb = None
            if torch is not None:
                tg, tu, tdy, tgu = [ctx.t(a) for a in gs], [ctx.t(a) for a in us], [ctx.t(a) for a in dys], [ctx.t(a) for a in gus]
                tgr = [a.clone().requires_grad_(True) for a in tg]
                tur = [a.clone().requires_grad_(True) for a in tu]
                tgur = [a.clone().requires_grad_(True) for a in tgu]
                tys = [F_.silu(g) * u for g, u in zip(tgr, tur)]
                tpk = [F_.silu(a[:, :F]) * a[:, F:] for a in tgur]
                tge = [F_.gelu(g, approximate="tanh") for g in tgr]
                tgee = [F_.gelu(g, approximate="none") for g in tgr]

                def t_sw(i, tg=tg, tu=tu):
                    return F_.silu(tg[i]) * tu[i]

                def t_swb(i, tys=tys, tgr=tgr, tur=tur, tdy=tdy):
                    return torch.autograd.grad(tys[i], (tgr[i], tur[i]), tdy[i], retain_graph=True)

                def t_pk(i, tgu=tgu, F=F):
                    g, u = tgu[i].chunk(2, -1)
                    return F_.silu(g) * u

                def t_pkb(i, tpk=tpk, tgur=tgur, tdy=tdy):
                    return torch.autograd.grad(tpk[i], (tgur[i],), tdy[i], retain_graph=True)

                def t_ge(i, tg=tg):
                    return F_.gelu(tg[i], approximate="tanh")

                def t_geb(i, tge=tge, tgr=tgr, tdy=tdy):
                    return torch.autograd.grad(tge[i], (tgr[i],), tdy[i], retain_graph=True)

                def t_gee(i, tg=tg):
                    return F_.gelu(tg[i], approximate="none")

                def t_geeb(i, tgee=tgee, tgr=tgr, tdy=tdy):
                    return torch.autograd.grad(tgee[i], (tgr[i],), tdy[i], retain_graph=True)

            ex = dict(nsets=k)
            out += [
                Case("swiglu fwd", shape, dn, 3 * n * sz, "3*N*s",
                     lambda i, gs=gs, us=us, ys=ys: ck.swiglu(gs[i], us[i], out=ys[i]), c_swiglu, t_sw, extra=ex),
                Case("swiglu bwd", shape, dn, 5 * n * sz, "5*N*s",
                     lambda i, gs=gs, us=us, dys=dys, dgs=dgs, dus=dus: ck.swiglu_backward(
                         gs[i], us[i], dys[i], out_dgate=dgs[i], out_dup=dus[i]), c_swiglu_bwd, t_swb, extra=ex),
                Case("swiglu_packed fwd", shape, dn, 3 * n * sz, "3*N*s (gu: N x 2 in, N out)",
                     lambda i, gus=gus, ys=ys: ck.swiglu_packed(gus[i], out=ys[i]), c_packed, t_pk, extra=ex),
                Case("swiglu_packed bwd", shape, dn, 5 * n * sz, "5*N*s",
                     lambda i, gus=gus, dys=dys, dgus=dgus: ck.swiglu_packed_backward(gus[i], dys[i], out=dgus[i]),
                     None, t_pkb, extra=ex),
                Case("gelu fwd", shape, dn, 2 * n * sz, "2*N*s",
                     lambda i, gs=gs, ys=ys: ck.gelu(gs[i], out=ys[i]), c_gelu, t_ge, extra=ex),
                Case("gelu bwd", shape, dn, 3 * n * sz, "3*N*s",
                     lambda i, gs=gs, dys=dys, dgs=dgs: ck.gelu_backward(gs[i], dys[i], out=dgs[i]), c_gelu_bwd, t_geb,
                     extra=ex),
                Case("gelu erf fwd", shape, dn, 2 * n * sz, "2*N*s",
                     lambda i, gs=gs, ys=ys: ck.gelu(gs[i], approximate="none", out=ys[i]), c_gelu_erf, t_gee,
                     note="exact form (erff); torch approximate='none'", extra=ex),
                Case("gelu erf bwd", shape, dn, 3 * n * sz, "3*N*s",
                     lambda i, gs=gs, dys=dys, dgs=dgs: ck.gelu_backward(gs[i], dys[i], approximate="none",
                                                                         out=dgs[i]),
                     c_gelu_erf_bwd, t_geeb, extra=ex),
            ]
    return out
