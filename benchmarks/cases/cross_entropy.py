"""Benchmark cases for ck.cross_entropy / _backward / _fused (kernels_cu/cross_entropy.cu)."""
import numpy as np

import cukernels as ck
from bench_ops import Case
from cukernels.blas import empty_padded

SHAPES = [(4096, 128256), (256, 128256), (8192, 50257)]


def cases(ctx):
    cp, torch = ctx.cp, ctx.torch
    out = []
    shapes = SHAPES[1:2] if ctx.quick else SHAPES
    dt, dn, s = ck.bfloat16, "bf16", 2
    for N, V in shapes:
        k = ctx.nsets(2 * N * V * s)
        xs = [cp.random.standard_normal((N, V), dtype=cp.float32).astype(dt) for _ in range(k)]
        ts = [cp.random.randint(0, V, N, dtype=cp.int64) for _ in range(k)]
        lses = [ck.cross_entropy(x, t, return_lse=True)[1] for x, t in zip(xs, ts)]
        dxs = [cp.empty_like(x) for x in xs]
        one = cp.ones((), dtype=cp.float32)

        def comp_fwd(i, xs=xs, ts=ts, N=N):
            xf = xs[i].astype(cp.float32)
            m = xf.max(1, keepdims=True)
            lse = m[:, 0] + cp.log(cp.exp(xf - m).sum(1))
            return (lse - xf[cp.arange(N), ts[i]]).mean()

        def comp_fused(i, xs=xs, ts=ts, N=N, dxs=dxs):
            xf = xs[i].astype(cp.float32)
            m = xf.max(1, keepdims=True)
            e = cp.exp(xf - m)
            ssum = e.sum(1, keepdims=True)
            loss = (m[:, 0] + cp.log(ssum[:, 0]) - xf[cp.arange(N), ts[i]]).mean()
            p = e / ssum
            p[cp.arange(N), ts[i]] -= 1
            dxs[i][...] = (p / N).astype(dxs[i].dtype)
            return loss

        tf = tb = tfb = None
        if torch is not None:
            F = torch.nn.functional
            tx = [ctx.t(x).clone().requires_grad_(True) for x in xs]
            tt = [torch.as_tensor(t, device="cuda") for t in ts]
            tl = [F.cross_entropy(a, b) for a, b in zip(tx, tt)]

            def tf(i, tx=tx, tt=tt):
                with torch.no_grad():
                    return F.cross_entropy(tx[i], tt[i])

            def tb(i, tx=tx, tl=tl):
                return torch.autograd.grad(tl[i], tx[i], retain_graph=True)

            def tfb(i, tx=tx, tt=tt):
                return torch.autograd.grad(F.cross_entropy(tx[i], tt[i]), tx[i])

        shape = f"{N}x{V}"
        out.append(Case("cross_entropy fwd (mean)", shape, dn, N * V * s + 12 * N, "N*V*s + 12*N",
                        lambda i, xs=xs, ts=ts: ck.cross_entropy(xs[i], ts[i]), comp_fwd, tf, extra=dict(nsets=k)))
        out.append(Case("cross_entropy bwd", shape, dn, 2 * N * V * s + 12 * N, "2*N*V*s + 12*N",
                        lambda i, xs=xs, ts=ts, lses=lses, dxs=dxs: ck.cross_entropy_backward(
                            xs[i], ts[i], lses[i], one, out=dxs[i]),
                        None, tb, extra=dict(nsets=k)))
        out.append(Case("cross_entropy fused fwd+bwd", shape, dn, 2 * N * V * s + 12 * N, "2*N*V*s + 12*N",
                        lambda i, xs=xs, ts=ts: ck.cross_entropy_fused(xs[i], ts[i], out=xs[i]),
                        comp_fused, tfb, note="in place over the logits; torch = F.cross_entropy fwd+bwd",
                        extra=dict(nsets=k)))
        if V % 64:
            # The same logits inside rows padded to a multiple of 64 (GPT-2: 50257 in 50304, as the LM head's
            # GEMMs want them): every row 16-byte aligned, so no scalar head; same bytes.
            ld = -(-V // 64) * 64
            pxs = [empty_padded((N, V), dt) for _ in range(k)]
            for p, x in zip(pxs, xs):
                p[...] = x

            def padded(i, pxs=pxs, ts=ts):
                return ck.cross_entropy_fused(pxs[i], ts[i], out=pxs[i])

            out.append(Case(f"cross_entropy fused fwd+bwd (ld {ld})", shape, dn, 2 * N * V * s + 12 * N,
                            "2*N*V*s + 12*N", padded, None, None,
                            note=f"in place, rows {ld} apart (padding never touched)", extra=dict(nsets=k)))
    return out
