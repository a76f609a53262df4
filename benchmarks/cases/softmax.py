"""Benchmark cases for ck.softmax / ck.softmax_backward / ck.attn_softmax / ck.attn_softmax_backward
(kernels_cu/softmax.cu)."""
import numpy as np

import cukernels as ck
from bench_ops import Case

# [4, 32, 1024, 1024] scores as rows first; then the column sweep (1, 128, 1000, 4096, 32768, 65536, 131072) at
# ~2^26 elements (32768: the wide forward, 512 threads a row bf16 / 1024 fp32; on sm_90 the cluster kernels take
# 65536 and 131072 both ways and the fp32 32768 backward, kernels_cu/softmax.cu; elsewhere the wide / loop ones).
SOFTMAX_SHAPES = [(131072, 1024), (1 << 22, 1), (1 << 19, 128), (65536, 1000), (16384, 4096), (2048, 32768),
                  (1024, 65536), (512, 131072)]
ATTN_SHAPE = (4, 32, 1024, 1024)
SCALE = 0.125
WINDOW = 256  # the sliding-window row (causal): query i reads min(i + 1, WINDOW) keys, writes all k_len


def _softmax_cases(ctx, dt, dn, N, C):
    cp, torch = ctx.cp, ctx.torch
    sz = np.dtype(dt).itemsize
    k = ctx.nsets(3 * N * C * sz)
    xs = [cp.random.standard_normal((N, C), dtype=cp.float32).astype(dt) for _ in range(k)]
    dys = [cp.random.standard_normal((N, C), dtype=cp.float32).astype(dt) for _ in range(k)]
    ys = [ck.softmax(x) for x in xs]
    outs = [cp.empty_like(x) for x in xs]

    def comp_fwd(i, xs=xs, dt=dt):
        z = xs[i].astype(cp.float32)
        e = cp.exp(z - z.max(-1, keepdims=True))
        return (e / e.sum(-1, keepdims=True)).astype(dt)

    def comp_bwd(i, ys=ys, dys=dys, dt=dt):
        y, g = ys[i].astype(cp.float32), dys[i].astype(cp.float32)
        return (y * (g - (g * y).sum(-1, keepdims=True))).astype(dt)

    tf = tb = None
    if torch is not None:
        tx, ty, tdy = [ctx.t(x) for x in xs], [ctx.t(y) for y in ys], [ctx.t(d) for d in dys]

        def tf(i, tx=tx):
            return torch.softmax(tx[i], -1)

        def tb(i, ty=ty, tdy=tdy):
            return torch._softmax_backward_data(tdy[i], ty[i], -1, ty[i].dtype)

    shape = f"{N}x{C}"

    def fwd(i, xs=xs, outs=outs):
        return ck.softmax(xs[i], out=outs[i])

    def bwd(i, ys=ys, dys=dys, outs=outs):
        return ck.softmax_backward(ys[i], dys[i], out=outs[i])

    out = [
        Case("softmax fwd", shape, dn, 2 * N * C * sz, "2*N*C*s", fwd, comp_fwd, tf, extra=dict(nsets=k)),
        Case("softmax bwd", shape, dn, 3 * N * C * sz, "3*N*C*s", bwd, comp_bwd, tb, extra=dict(nsets=k)),
    ]
    # A/B rows for the sm_90 cluster kernels (ops/softmax.py settings, held while the call is captured): off (the
    # wide / loop kernels), CTAs of 256 threads (4 a SM), a grid of 264 CTAs (one wave at 2 a SM, clusters walking
    # rows), and at 32768 the forward forced onto 2-CTA clusters.
    if int(ctx.cp.cuda.Device().compute_capability) >= 90 and C >= 32768:
        rows = [("softmax_cluster_fwd_from_f32=16384,softmax_cluster_fwd_from_bf16=16384", True, False)] if C == 32768 \
            else [("softmax_cluster=0", True, True), ("softmax_cluster_threads=256", True, True),
                  ("softmax_cluster_max_grid=264", True, True)]
        for spec, do_fwd, do_bwd in rows:
            for name, fn, nb, formula, on in (("fwd", fwd, 2, "2*N*C*s", do_fwd), ("bwd", bwd, 3, "3*N*C*s", do_bwd)):
                if on:
                    out.append(Case(f"softmax {name}", shape, dn, nb * N * C * sz, formula, _with(spec, fn),
                                    note=f"A/B {spec}", extra=dict(nsets=k)))
    return out


def _with(spec, fn):
    """fn with the ck.settings of ``spec`` ("name=v,name=v", the environment's text form) in force while it runs (so
    while it is captured: the graph keeps the kernel chosen then)."""
    values = {k.strip(): ck.settings.parse(k.strip(), v) for k, v in (one.split("=") for one in spec.split(","))}

    def run(i):
        with ck.settings(**values):
            return fn(i)

    return run


def _attn_cases(ctx, dt, dn):
    cp, torch = ctx.cp, ctx.torch
    Bn, H, Q, K = ATTN_SHAPE
    N = Bn * H * Q
    sz = np.dtype(dt).itemsize
    k = ctx.nsets(3 * N * K * sz)
    ss = [cp.random.standard_normal(ATTN_SHAPE, dtype=cp.float32).astype(dt) for _ in range(k)]
    dps = [cp.random.standard_normal(ATTN_SHAPE, dtype=cp.float32).astype(dt) for _ in range(k)]
    keep = cp.random.random((Bn, K)) > 0.1
    keep[:, :8] = True
    outs = [cp.empty_like(s) for s in ss]
    ps = [ck.attn_softmax(s, key_mask=keep, scale=SCALE) for s in ss]
    causal_keep = cp.tril(cp.ones((Q, K), dtype=cp.bool_), K - Q)
    window_keep = causal_keep & ~cp.tril(cp.ones((Q, K), dtype=cp.bool_), K - Q - WINDOW)

    def comp(i, keep4, ss=ss, dt=dt):
        z = cp.where(keep4, ss[i].astype(cp.float32) * SCALE, -cp.inf)
        m = z.max(-1, keepdims=True)
        e = cp.exp(z - cp.where(cp.isneginf(m), 0, m))
        s = e.sum(-1, keepdims=True)
        return (e / cp.where(s > 0, s, 1)).astype(dt)

    def comp_bwd(i, ps=ps, dps=dps, dt=dt):
        p, g = ps[i].astype(cp.float32), dps[i].astype(cp.float32)
        return (SCALE * p * (g - (g * p).sum(-1, keepdims=True))).astype(dt)

    t_mask = t_causal = t_window = t_none = tb = None
    if torch is not None:
        ts, tp, tdp = [ctx.t(s) for s in ss], [ctx.t(p) for p in ps], [ctx.t(d) for d in dps]
        tkeep = torch.as_tensor(keep, device="cuda")
        tdrop = ~tkeep[:, None, None, :]
        tcausal_drop = ~torch.as_tensor(causal_keep, device="cuda")
        twindow_drop = ~torch.as_tensor(window_keep, device="cuda")

        def t_none(i, ts=ts):
            return torch.softmax(ts[i] * SCALE, -1)

        def t_mask(i, ts=ts):
            return torch.softmax((ts[i] * SCALE).masked_fill(tdrop, float("-inf")), -1)

        def t_causal(i, ts=ts):
            return torch.softmax((ts[i] * SCALE).masked_fill(tcausal_drop, float("-inf")), -1)

        def t_window(i, ts=ts):
            return torch.softmax((ts[i] * SCALE).masked_fill(twindow_drop, float("-inf")), -1)

        def tb(i, tp=tp, tdp=tdp):
            return torch._softmax_backward_data(tdp[i], tp[i], -1, tp[i].dtype) * SCALE

    shape = "x".join(map(str, ATTN_SHAPE))
    io = 2 * N * K * sz
    causal_read = Bn * H * (Q * (K - Q) + Q * (Q + 1) // 2) * sz
    window_read = Bn * H * sum(min(i + K - Q + 1, WINDOW) for i in range(Q)) * sz
    return [
        Case("attn_softmax fwd", shape, dn, io, "2*N*K*s",
             lambda i, ss=ss, outs=outs: ck.attn_softmax(ss[i], scale=SCALE, out=outs[i]),
             lambda i: comp(i, cp.ones((), dtype=cp.bool_)), t_none, extra=dict(nsets=k)),
        Case("attn_softmax fwd key_mask", shape, dn, io + Bn * K, "2*N*K*s + B*K",
             lambda i, ss=ss, outs=outs: ck.attn_softmax(ss[i], key_mask=keep, scale=SCALE, out=outs[i]),
             lambda i: comp(i, keep[:, None, None, :]), t_mask, extra=dict(nsets=k)),
        Case("attn_softmax fwd causal", shape, dn, causal_read + N * K * sz, "B*H*(Q*(K-Q)+Q*(Q+1)/2)*s + N*K*s",
             lambda i, ss=ss, outs=outs: ck.attn_softmax(ss[i], causal=True, scale=SCALE, out=outs[i]),
             lambda i: comp(i, causal_keep), t_causal, extra=dict(nsets=k),
             note="reads only the live keys"),
        Case(f"attn_softmax fwd window {WINDOW}", shape, dn, window_read + N * K * sz,
             "B*H*sum_i min(i+K-Q+1, W)*s + N*K*s",
             lambda i, ss=ss, outs=outs: ck.attn_softmax(ss[i], causal=True, scale=SCALE, window=WINDOW, out=outs[i]),
             lambda i: comp(i, window_keep), t_window, extra=dict(nsets=k),
             note="reads only the keys in each query's window"),
        Case("attn_softmax bwd", shape, dn, 3 * N * K * sz, "3*N*K*s",
             lambda i, ps=ps, dps=dps, outs=outs: ck.attn_softmax_backward(ps[i], dps[i], scale=SCALE, out=outs[i]),
             comp_bwd, tb, extra=dict(nsets=k)),
    ]


def cases(ctx):
    out = []
    shapes = SOFTMAX_SHAPES[:1] if ctx.quick else SOFTMAX_SHAPES
    for dt, dn in ((np.float32, "f32"), (ck.bfloat16, "bf16")):
        for N, C in shapes:
            out += _softmax_cases(ctx, dt, dn, N, C)
        out += _attn_cases(ctx, dt, dn)
    return out
