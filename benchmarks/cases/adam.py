"""Benchmark cases for ck.adam_step / ck.adam_step_rows / ck.global_norm (kernels_cu/adam.cu).

Bytes are the fewest the update must move: per parameter 4 fp32 reads (p, g, m, v) + 3 fp32 writes (p, m, v)
= 28 B; +2 B for the bf16 shadow write; -2 B when the gradient is bf16; +1 B for E4M3 shadow codes (+2 B
for their transposes). lr and step are device scalars (as in
a captured training step). The torch row is torch.optim.AdamW(fused=True, capturable=True) on the same
parameter memory (fp32 grads only: fused AdamW needs grad dtype == param dtype; it has no shadow, so the
shadow rows compare against its plain update).
"""
import numpy as np

import cukernels as ck
from bench_ops import Case

SIZES = [16_777_216, 1_500_000_000]
LR, WD = 1e-4, 0.1
EMB_V, EMB_D, EMB_ROWS, EMB_CAP = 128256, 2048, 256, 8192


def _composite(cp, p, g, m, v, lr, t, sh=None, b1=0.9, b2=0.999, eps=1e-8, wd=WD):
    """The same update from CuPy elementwise ops (in place where CuPy allows)."""
    gf = g.astype(cp.float32) if g.dtype != cp.float32 else g
    m *= b1
    m += (1 - b1) * gf
    v *= b2
    v += (1 - b2) * gf * gf
    p *= 1 - lr * wd
    denom = cp.sqrt(v)
    denom *= 1 / np.sqrt(1 - b2 ** t)
    denom += eps
    p -= (lr / (1 - b1 ** t)) * m / denom
    if sh is not None:
        sh[...] = p.astype(sh.dtype)


def _dense_cases(ctx, n):
    cp, torch = ctx.cp, ctx.torch
    out = []
    p = cp.random.standard_normal(n, dtype=cp.float32)
    g = cp.random.standard_normal(n, dtype=cp.float32) * 0.01
    m, v = cp.zeros_like(p), cp.zeros_like(p)
    sh = p.astype(ck.bfloat16)
    gb = g.astype(ck.bfloat16)
    lr_d, step_d = cp.array(LR, cp.float32), cp.array(1000, cp.int32)
    big = n >= 10**8

    def ours(shadow=None, grad=g):
        return lambda i: ck.adam_step(p, grad, m, v, lr=lr_d, step=step_d, weight_decay=WD, shadow=shadow)

    tstep = None
    if torch is not None:
        tp = torch.nn.Parameter(ctx.t(p))  # shares our memory
        tp.grad = ctx.t(g)
        topt = torch.optim.AdamW([tp], lr=LR, weight_decay=WD, fused=True, capturable=True)

        def tstep(i, topt=topt):
            topt.step()

    shape = f"{n / 1e6:.1f}M params" if n < 10**9 else f"{n / 1e9:.2f}B params"
    out.append(Case("adam_step", shape, "f32", 28 * n, "28*n", ours(),
                    lambda i: _composite(cp, p, g, m, v, LR, 1000), tstep))
    out.append(Case("adam_step +bf16 shadow", shape, "f32", 30 * n, "30*n", ours(sh),
                    None if big else (lambda i: _composite(cp, p, g, m, v, LR, 1000, sh)), tstep,
                    note="torch: no shadow"))
    out.append(Case("adam_step bf16 grad +shadow", shape, "f32", 28 * n, "28*n", ours(sh, gb),
                    None if big else (lambda i: _composite(cp, p, gb, m, v, LR, 1000, sh)), None))
    # FP8 shadows (AdamW(fp8_shadows=True)): E4M3 codes of [2048, 8192] weights tiling the buffer instead of the bf16
    # copy, then their transposes: 26 B + 1 B codes + 2 B transpose = 29 B/param, against 28 B for the bf16 shadow
    # plus the 4 B/param cast + transpose the FP8 forward then does on every weight (32 B).
    W = 2048 * 8192
    fs = ck.Fp8Shadow(p, [(k * W, (2048, 8192)) for k in range(n // W)])
    out.append(Case("adam_step bf16 grad +fp8 shadow", shape, "f32", 29 * n, "29*n",
                    lambda i: ck.adam_step(p, gb, m, v, lr=lr_d, step=step_d, weight_decay=WD, fp8_shadow=fs),
                    None, None, note="+ transposes"))
    nrm = (lambda i: ck.global_norm(g))
    tn = (lambda i: torch.linalg.vector_norm(tp.grad)) if torch is not None else None
    out.append(Case("global_norm", shape, "f32", 4 * n, "4*n", nrm,
                    lambda i: cp.sqrt(cp.sum(g * g)), tn))
    return out


def _sparse_cases(ctx):
    cp = ctx.cp
    V, D, R = EMB_V, EMB_D, EMB_ROWS
    p = cp.random.standard_normal((V, D), dtype=cp.float32)
    g = cp.random.standard_normal((V, D), dtype=cp.float32) * 0.01
    m, v = cp.zeros_like(p), cp.zeros_like(p)
    sh = p.astype(ck.bfloat16)
    nbytes = R * D * 28 + R * 4
    k = ctx.nsets(nbytes)
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(k):  # a different set of touched rows per input set (the table is far bigger than L2)
        r = np.zeros(EMB_CAP, np.int32)
        r[:R] = rng.choice(V, R, replace=False)
        rows.append(cp.asarray(r))
    count = cp.array(R, cp.int32)
    lr_d, step_d = cp.array(LR, cp.float32), cp.array(1000, cp.int32)

    def ours(shadow):
        return lambda i: ck.adam_step_rows(p, g, m, v, rows[i], count, lr=lr_d, step=step_d, weight_decay=WD,
                                           shadow=shadow)

    def comp(i, shadow=None):
        idx = rows[i][:R]
        P, G, M, Vv = p[idx], g[idx], m[idx], v[idx]
        S = None if shadow is None else shadow[idx]
        _composite(cp, P, G, M, Vv, LR, 1000, S)
        p[idx], m[idx], v[idx] = P, M, Vv
        if shadow is not None:
            shadow[idx] = S

    shape = f"{R} rows of {V}x{D}"
    note = f"rows capacity {EMB_CAP}, count on device"
    return [
        Case("adam_step_rows", shape, "f32", nbytes, "28*R*D + 4*R", ours(None), comp, None, note=note,
             extra=dict(nsets=k)),
        Case("adam_step_rows +bf16 shadow", shape, "f32", nbytes + 2 * R * D, "30*R*D + 4*R", ours(sh),
             lambda i: comp(i, sh), None, note=note, extra=dict(nsets=k)),
    ]


def cases(ctx):
    sizes = SIZES[:1] if ctx.quick else SIZES
    out = []
    for n in sizes:
        out += _dense_cases(ctx, n)
    out += _sparse_cases(ctx)
    return out
