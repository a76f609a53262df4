"""Benchmark cases for ck.matmul (cukernels/blas.py): GPT-2's LM-head GEMMs, V = 50257, on unpadded logits and on
the same logits inside rows 50304 apart.

    logits  z = x @ W^T          [N, V]  (out row stride: V, or 50304 through blas.empty_padded)
    dx        = dz @ W           [N, H]  (dz read with row stride V or 50304)
    dW       += dz^T @ x         [V, H]  fp32, beta = 1 (the weight gradient accumulated in place)

Unpadded bf16 rows are 100514 B, not a multiple of 16: cuBLAS can only take its align1 kernels
(cutlass_75_tensorop_*_align1; 6.7 + 4.6 + 4.4 ms in a profiled GPT-2 step at N = 8192). Padded rows keep every
row 16-byte aligned while V stays 50257. Compute-bound: the TFLOP/s column counts 2 N H V per GEMM; bytes count
each operand once (the dW output read and written). "x torch": torch.mm on the unpadded buffers (out= given).
"""
import cukernels as ck
from bench_ops import Case
from cukernels.blas import empty_padded

SHAPES = [(8192, 768, 50257)]  # GPT-2 124M at B8 x T1024


def cases(ctx):
    cp, torch = ctx.cp, ctx.torch
    out = []
    bf, s = ck.bfloat16, 2
    for N, H, V in SHAPES:
        x = cp.random.standard_normal((N, H), dtype=cp.float32).astype(bf)
        w = (cp.random.standard_normal((V, H), dtype=cp.float32) * H ** -0.5).astype(bf)
        zc = (cp.random.standard_normal((N, V), dtype=cp.float32) * V ** -0.5).astype(bf)  # [N, V], rows V apart
        zp = empty_padded((N, V), bf)  # the same values, rows 50304 apart
        zp[...] = zc
        ld = zp.strides[0] // s
        dx = cp.empty((N, H), dtype=bf)
        gw = cp.zeros((V, H), dtype=cp.float32)
        flops = 2.0 * N * H * V
        shape = f"{N}x{H}x{V}"
        t_logits = t_dx = None
        if torch is not None:
            tx, tw, tz, tdx = ctx.t(x), ctx.t(w), ctx.t(zc), ctx.t(dx)

            def t_logits(i, tx=tx, tw=tw, tz=tz):
                return torch.mm(tx, tw.t(), out=tz)

            def t_dx(i, tz=tz, tw=tw, tdx=tdx):
                return torch.mm(tz, tw, out=tdx)

        for lay, z in (("ld V", zc), (f"ld {ld}", zp)):
            pad = z is zp
            out += [
                Case(f"matmul logits x@W^T ({lay})", shape, "bf16", (N * H + V * H + N * V) * s, "(NH + VH + NV)*s",
                     lambda i, z=z, x=x, w=w: ck.matmul(x, w, trans_b=True, out=z), None, None if pad else t_logits,
                     note="out rows padded (empty_padded)" if pad else "out [N, 50257]: 100514-byte rows",
                     flops=flops),
                Case(f"matmul dx=dz@W ({lay})", shape, "bf16", (N * V + V * H + N * H) * s, "(NV + VH + NH)*s",
                     lambda i, z=z, w=w, dx=dx: ck.matmul(z, w, out=dx), None, None if pad else t_dx, flops=flops),
                Case(f"matmul dW+=dz^T@x ({lay})", shape, "bf16", (N * V + N * H) * s + 2 * V * H * 4,
                     "(NV + NH)*s + 2*VH*4", lambda i, z=z, x=x, gw=gw: ck.matmul(z, x, trans_a=True, out=gw, beta=1.0),
                     None, None, note="fp32 out, beta = 1", flops=flops),
            ]
    return out
