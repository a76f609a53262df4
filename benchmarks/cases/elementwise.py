"""Benchmark cases for ck.add / ck.mul / ck.cast (kernels_cu/elementwise.cu)."""
import numpy as np

import cukernels as ck
from bench_ops import Case

SIZES = [2**24, 2**27]  # 16.8 M and 134 M elements (2048 x 8192 and 16384 x 8192 activations)


def cases(ctx):
    cp, torch = ctx.cp, ctx.torch
    out = []
    sizes = SIZES[:1] if ctx.quick else SIZES
    bf, f32 = ck.bfloat16, np.float32
    for n in sizes:
        rnd = lambda dt: cp.random.standard_normal(n, dtype=cp.float32).astype(dt)
        shape = f"{n // 8192}x8192"

        # residual stream: fp32 h += bf16 branch output, in place (10 B/element)
        k = ctx.nsets(10 * n)
        hs, ds = [rnd(f32) for _ in range(k)], [rnd(bf) for _ in range(k)]
        th = td = None
        if torch is not None:
            th, td = [ctx.t(a) for a in hs], [ctx.t(a) for a in ds]
        out.append(Case("add fp32 += bf16 (in place)", shape, "mixed", 10 * n, "(4+2+4)*N",
                        lambda i, hs=hs, ds=ds: ck.add(hs[i], ds[i], out=hs[i]),
                        lambda i, hs=hs, ds=ds: cp.add(hs[i], ds[i].astype(cp.float32), out=hs[i]),
                        (lambda i, th=th, td=td: th[i].add_(td[i])) if torch is not None else None, extra=dict(nsets=k)))

        # bf16 + bf16 -> bf16, bf16 * bf16 -> bf16 (6 B/element)
        k = ctx.nsets(6 * n)
        a_s, b_s = [rnd(bf) for _ in range(k)], [rnd(bf) for _ in range(k)]
        ys = [cp.empty_like(a) for a in a_s]
        ta = tb = None
        if torch is not None:
            ta, tb = [ctx.t(a) for a in a_s], [ctx.t(b) for b in b_s]
        out.append(Case("add bf16 + bf16", shape, "bf16", 6 * n, "3*N*2",
                        lambda i, a_s=a_s, b_s=b_s, ys=ys: ck.add(a_s[i], b_s[i], out=ys[i]),
                        lambda i, a_s=a_s, b_s=b_s: (a_s[i].astype(cp.float32) + b_s[i].astype(cp.float32)).astype(bf),
                        (lambda i, ta=ta, tb=tb: ta[i] + tb[i]) if torch is not None else None, extra=dict(nsets=k)))
        out.append(Case("mul bf16 * bf16", shape, "bf16", 6 * n, "3*N*2",
                        lambda i, a_s=a_s, b_s=b_s, ys=ys: ck.mul(a_s[i], b_s[i], out=ys[i]),
                        lambda i, a_s=a_s, b_s=b_s: (a_s[i].astype(cp.float32) * b_s[i].astype(cp.float32)).astype(bf),
                        (lambda i, ta=ta, tb=tb: ta[i] * tb[i]) if torch is not None else None, extra=dict(nsets=k)))

        # casts (6 B/element)
        k = ctx.nsets(6 * n)
        xs32 = [rnd(f32) for _ in range(k)]
        y16 = [cp.empty(n, dtype=bf) for _ in range(k)]
        xs16 = [rnd(bf) for _ in range(k)]
        y32 = [cp.empty(n, dtype=f32) for _ in range(k)]
        t32 = t16 = None
        if torch is not None:
            t32, t16 = [ctx.t(a) for a in xs32], [ctx.t(a) for a in xs16]
        out.append(Case("cast fp32 -> bf16", shape, "f32>bf16", 6 * n, "N*(4+2)",
                        lambda i, xs=xs32, ys=y16: ck.cast(xs[i], bf, out=ys[i]),
                        lambda i, xs=xs32: xs[i].astype(bf),
                        (lambda i, t=t32: t[i].to(torch.bfloat16)) if torch is not None else None, extra=dict(nsets=k)))
        out.append(Case("cast bf16 -> fp32", shape, "bf16>f32", 6 * n, "N*(2+4)",
                        lambda i, xs=xs16, ys=y32: ck.cast(xs[i], f32, out=ys[i]),
                        lambda i, xs=xs16: xs[i].astype(cp.float32),
                        (lambda i, t=t16: t[i].to(torch.float32)) if torch is not None else None, extra=dict(nsets=k)))
    return out
