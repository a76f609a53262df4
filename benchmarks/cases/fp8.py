"""Benchmark cases for the FP8 casts (ck.fp8_amax / fp8_cast / fp8_quantize / fp8_dequantize, kernels_cu/fp8.cu) and
the FP8 GEMM (ck.matmul on FP8 operands, cuBLASLt: cukernels/blaslt.py).

Casts are memory-bound: bytes per element of a bf16 x (benchmarks/NOTES.md, "FP8"):

    amax                 read 2                      2 B
    cast (flat)          read 2, write 1             3 B
    cast + transpose     read 2, write 1 + 1         4 B    (the K-major copy cuBLASLt's FP8 layout needs)
    quantize, current    amax pass + cast_t          6 B    (two launches; the scale computed in the cast kernel)
    quantize, delayed    cast_t with the history     4 B    (one launch)
    transpose (codes)    read 1, write 1             2 B    (a weight's q^T from the optimizer's FP8 copy)
    dequantize -> bf16   read 1, write 2             3 B

Shapes: [8192, 2048] (the 1B step's hidden activations at B8 x T1024) and [8192, 8192] (its FFN activations).
"x torch": the same cast in PyTorch (``(x * s).clamp(-448, 448).to(torch.float8_e4m3fn)``, ``.t().contiguous()``
for the transposed copy, ``x.abs().amax()``), eager as a user writes it; no CuPy composite exists (CuPy has no
float8 dtype). The GEMM rows are compute-bound (TFLOP/s: 2 M N K): FP8 e4m3 x e4m3 -> bf16 and the weight
gradient's e5m2 x e4m3 -> fp32 with beta = 1 at 8192^3, the "x cupy" column there being **our bf16 GEMM at the same
shape** (ck.matmul, cuBLAS) -- the issue's >= 1.6x -- and "x torch" ``torch._scaled_mm`` on the same bits.
"""
import numpy as np

import cukernels as ck
from bench_ops import Case

SHAPES = [(8192, 2048), (8192, 8192)]
GEMM = [(8192, 8192, 8192)]
E4, E5 = ck.float8_e4m3fn, ck.float8_e5m2


def cases(ctx):
    out = []
    for R, C in SHAPES[:1] if ctx.quick else SHAPES:
        out += _cast_cases(ctx, R, C)  # (one function call a shape: the lambdas bind that shape's arrays)
    for M, N, K in GEMM:
        out += _gemm_cases(ctx, M, N, K)
    return out


def _cast_cases(ctx, R, C):
    cp, torch = ctx.cp, ctx.torch
    bf = ck.bfloat16
    n = R * C
    shape = f"{R}x{C}"
    k = ctx.nsets(6 * n)
    xs = [(cp.random.standard_normal((R, C), dtype=cp.float32) * 3).astype(bf) for _ in range(k)]
    qs = [cp.empty((R, C), cp.uint8) for _ in range(k)]
    qts = [cp.empty((C, R), cp.uint8) for _ in range(k)]
    ys = [cp.empty((R, C), bf) for _ in range(k)]
    amax = cp.zeros((), cp.float32)
    s = cp.asarray(np.float32(448.0 / 12.0))
    si = cp.asarray(np.float32(12.0 / 448.0))
    hists = [ck.fp8_history(x) for x in xs]
    tx = ts = tq = None
    if torch is not None:
        tx = [ctx.t(x) for x in xs]
        tq = [ctx.t(q).view(torch.float8_e4m3fn) for q in qs]
        ts = torch.tensor(448.0 / 12.0, device="cuda")
    tor = (lambda f: f) if torch is not None else (lambda f: None)
    return [
        Case("fp8_amax bf16", shape, "bf16", 2 * n, "N*2", lambda i: ck.fp8_amax(xs[i], out=amax), None,
             tor(lambda i: tx[i].abs().amax()), extra=dict(nsets=k)),
        Case("fp8_cast bf16->e4m3", shape, "bf16", 3 * n, "N*(2+1)",
             lambda i: ck.fp8_cast(xs[i], s, out=qs[i]), None,
             tor(lambda i: (tx[i] * ts).clamp(-448, 448).to(torch.float8_e4m3fn)), extra=dict(nsets=k)),
        Case("fp8_cast +T bf16->e4m3", shape, "bf16", 4 * n, "N*(2+1+1)",
             lambda i: ck.fp8_cast(xs[i], s, transpose=True, out=qs[i], out_t=qts[i]), None,
             tor(lambda i: (lambda q: (q, q.t().contiguous()))(
                 (tx[i] * ts).clamp(-448, 448).to(torch.float8_e4m3fn))), extra=dict(nsets=k)),
        Case("fp8_quantize +T current", shape, "bf16", 6 * n, "N*(2+2+1+1)",
             lambda i: ck.fp8_quantize(xs[i], transpose=True, out=qs[i], out_t=qts[i]), None,
             tor(lambda i: (lambda q: (q, q.t().contiguous()))(
                 (tx[i] * (448.0 / tx[i].abs().amax().float())).clamp(-448, 448).to(torch.float8_e4m3fn))),
             note="amax pass + cast_t", extra=dict(nsets=k)),
        Case("fp8_quantize +T delayed", shape, "bf16", 4 * n, "N*(2+1+1)",
             lambda i: ck.fp8_quantize(xs[i], transpose=True, history=hists[i], out=qs[i], out_t=qts[i]), None,
             None, note="one pass, amax into the history", extra=dict(nsets=k)),
        Case("fp8_quantize grad e5m2 +T", shape, "bf16", 6 * n, "N*(2+2+1+1)",
             lambda i: ck.fp8_quantize(xs[i], dtype=E5, transpose=True, out=qs[i], out_t=qts[i]), None, None,
             extra=dict(nsets=k)),
        Case("fp8_transpose e4m3", shape, "e4m3", 2 * n, "N*(1+1)",
             lambda i: ck.fp8_transpose(qs[i], out=qts[i]), None,
             tor(lambda i: tq[i].t().contiguous()), note="the weights' q^T", extra=dict(nsets=k)),
        Case("fp8_dequantize e4m3->bf16", shape, "e4m3", 3 * n, "N*(1+2)",
             lambda i: ck.fp8_dequantize(qs[i], si, q_dtype=E4, dtype=bf, out=ys[i]), None, None,
             extra=dict(nsets=k)),
    ]


def _gemm_cases(ctx, M, N, K):
    cp, torch = ctx.cp, ctx.torch
    bf = ck.bfloat16
    shape = f"{M}x{N}x{K}"
    a = (cp.random.standard_normal((M, K), dtype=cp.float32)).astype(bf)
    b = (cp.random.standard_normal((N, K), dtype=cp.float32) * K ** -0.5).astype(bf)
    aq, sa = ck.fp8_quantize(a)
    bq, sb = ck.fp8_quantize(b)
    gq, sg = ck.fp8_quantize(a, dtype=E5)
    y = cp.empty((M, N), bf)
    dw = cp.zeros((M, N), cp.float32)
    flops = 2.0 * M * N * K
    bf16_gemm = lambda i: ck.matmul(a, b, trans_b=True, out=y)  # noqa: E731  our bf16 GEMM, same shape
    t_fwd = t_wg = None
    if torch is not None:
        taq, tbq = ctx.t(aq).view(torch.float8_e4m3fn), ctx.t(bq).view(torch.float8_e4m3fn)
        tgq = ctx.t(gq).view(torch.float8_e5m2)
        tsa, tsb, tsg = ctx.t(sa), ctx.t(sb), ctx.t(sg)

        def t_fwd(i):
            return torch._scaled_mm(taq, tbq.t(), scale_a=tsa, scale_b=tsb, out_dtype=torch.bfloat16,
                                    use_fast_accum=True)

        def t_wg(i):
            return torch._scaled_mm(tgq, tbq.t(), scale_a=tsg, scale_b=tsb, out_dtype=torch.float32)

    return [
        Case("matmul bf16 x@W^T (ours)", shape, "bf16", (M * K + N * K + M * N) * 2, "(MK + NK + MN)*2",
             bf16_gemm, None, None, flops=flops),
        Case("matmul fp8 e4m3 x@W^T", shape, "e4m3", M * K + N * K + M * N * 2, "MK + NK + MN*2",
             lambda i: ck.matmul(aq, bq, trans_b=True, a_scale=sa, b_scale=sb, a_dtype=E4, b_dtype=E4, out=y,
                                 fast_accum=True), bf16_gemm, t_fwd,
             note="fast accum; 'x cupy' = over our bf16 GEMM", flops=flops),
        Case("matmul fp8 e4m3 (no fast acc)", shape, "e4m3", M * K + N * K + M * N * 2, "MK + NK + MN*2",
             lambda i: ck.matmul(aq, bq, trans_b=True, a_scale=sa, b_scale=sb, a_dtype=E4, b_dtype=E4, out=y),
             bf16_gemm, None, note="'x cupy' = over our bf16 GEMM", flops=flops),
        Case("matmul fp8 e5m2xe4m3 +=fp32", shape, "e5m2", M * K + N * K + M * N * 8, "MK + NK + 2*MN*4",
             lambda i: ck.matmul(gq, bq, trans_b=True, a_scale=sg, b_scale=sb, a_dtype=E5, b_dtype=E4, out=dw,
                                 beta=1.0), None, t_wg, note="the weight-gradient form: beta = 1 into fp32",
             flops=flops),
    ]
