"""Benchmark cases for ck.gemv (kernels_cu/gemv.cu): the GEMVs of a LLaMA-3.2-1B decode step (hidden 2048, 32/8
heads of 64, MLP 8192, vocabulary 128256), at B = 1 and 8 rows:

    qkv      [3072, 2048]    rms prologue (input_layernorm)
    o        [2048, 2048]    + residual, in place (the residual stream)
    gate_up  [16384, 2048]   rms prologue (post_attention_layernorm), SwiGLU epilogue -> [B, 8192]
    down     [2048, 8192]    + residual, in place
    head     [128256, 2048]  rms prologue (the final norm), fp32 logits

Memory-bound on the weight: GB/s counts the weight bytes only (N * K * 2; x, out and residual are < 0.3 % at
B = 8), the number the decode step's floor is made of. "x cupy": the unfused composition of our own ops
(ck.rms_norm, ck.matmul on cuBLAS, ck.swiglu_packed, ck.add), the path the model's decode step takes today;
"x torch": ``x @ W.T`` in torch bf16 (torch.mm with out=; no norm / activation / residual: the GEMV alone).
At B = 8 each shape runs twice: the default (a warp takes G = 2 adjacent columns, ck.settings.gemv_pair_min_nb) and "G1"
(one column a warp), to settle the choice on the device.
"""
import numpy as np

import cukernels as ck
from bench_ops import Case
from cukernels.ops.gemv import gemv

H, I, V = 2048, 8192, 128256
SHAPES = [  # (name, N, K, norm, act, residual, fp32 out)
    ("qkv", 3072, H, "rms", None, False, False),
    ("o", H, H, None, None, True, False),
    ("gate_up", 2 * I, H, "rms", "swiglu", False, False),
    ("down", H, I, None, None, True, False),
    ("head", V, H, "rms", None, False, True),
]


def cases(ctx):
    cp, torch = ctx.cp, ctx.torch
    bf = ck.bfloat16
    out = []
    shapes = SHAPES[:3] if ctx.quick else SHAPES
    for Bn in (1, 8):
        for name, N, K, norm, act, res, f32out in shapes:
            wbytes = N * K * 2
            k_ = ctx.nsets(wbytes)
            ws = [(cp.random.standard_normal((N, K), dtype=cp.float32) * K ** -0.5).astype(bf) for _ in range(k_)]
            x = cp.random.standard_normal((Bn, K), dtype=cp.float32).astype(bf)
            nw = cp.ones(K, dtype=cp.float32) if norm else None
            n_out = N // 2 if act == "swiglu" else N
            odt = cp.float32 if f32out else bf
            o = cp.random.standard_normal((Bn, n_out), dtype=cp.float32).astype(odt)
            kw = dict(norm=norm, norm_weight=nw, act=act)

            def ours(i, ws=ws, x=x, o=o, kw=kw, res=res):
                return gemv(x, ws[i], residual=o if res else None, out=o, **kw)

            def comp(i, ws=ws, x=x, o=o, nw=nw, norm=norm, act=act, res=res, odt=odt):
                xn = ck.rms_norm(x, nw, 1e-5) if norm else x
                y = ck.matmul(xn, ws[i], trans_b=True, out_dtype=odt)
                if act == "swiglu":
                    y = ck.swiglu_packed(y)
                return ck.add(o, y, out=o) if res else y

            tf = None
            if torch is not None:
                tx, tw = ctx.t(x), [ctx.t(w) for w in ws]
                ty = torch.empty((Bn, N), dtype=torch.bfloat16, device="cuda")

                def tf(i, tx=tx, tw=tw, ty=ty):
                    return torch.mm(tx, tw[i].t(), out=ty)

            note = "+".join(p for p in (norm and f"{norm} prologue", act, res and "residual in place",
                                        f32out and "fp32 out") if p)
            out.append(Case(f"gemv {name}", f"B{Bn} {N}x{K}", "bf16", wbytes, "N*K*2 (weight only)", ours, comp,
                            tf, note=note, extra=dict(nsets=k_)))
            if Bn >= 3:

                def ours_g1(i, ours=ours):
                    with ck.settings(gemv_pair_min_nb=99):  # one column a warp
                        return ours(i)

                out.append(Case(f"gemv {name} G1", f"B{Bn} {N}x{K}", "bf16", wbytes, "N*K*2 (weight only)", ours_g1,
                                None, None, note=note + " (one column a warp)", extra=dict(nsets=k_)))
    return out
