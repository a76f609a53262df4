"""Benchmark cases for sample_tokens (kernels_cu/sampling.cu): greedy, top-k 50, top-p 0.9 at B 1 / 8 / 64 over
LLaMA-3's and GPT-2's vocabularies, fp32 logits (the LM head's output).

Bytes: the logits read once (B * V * 4); the kernel makes 2 (greedy: 1) to ~8 passes over a row, the later ones
from L2, so GB/s here is a lower bound of the traffic. One block per row: at B = 1 a single SM does the work,
so the figure to read is the time. "x cupy": argmax / sort-based composites in CuPy; "x torch": argmax,
topk + softmax + multinomial, sort + cumsum + multinomial (what transformers' samplers run).
"""
import numpy as np

from bench_ops import Case
from cukernels.ops.sampling import sample_tokens

MODES = [("greedy", dict(temperature=0.0)), ("top-k 50", dict(temperature=0.8, top_k=50)),
         ("top-p 0.9", dict(temperature=0.8, top_p=0.9))]


def cases(ctx):
    cp, torch = ctx.cp, ctx.torch
    out = []
    for V in ((128256,) if ctx.quick else (128256, 50257)):
        for Bsz in ((8,) if ctx.quick else (1, 8, 64)):
            k_ = ctx.nsets(Bsz * V * 4)
            # LM-head-like rows: a broad low bulk and a few high logits
            ls = []
            for _ in range(k_):
                x = cp.random.standard_normal((Bsz, V), dtype=cp.float32) * 2 - 4
                x[:, cp.random.randint(0, V, 20)] += 14
                ls.append(x)
            res = cp.empty((Bsz,), dtype=cp.int32)
            offset = cp.zeros((), dtype=cp.int64)
            for name, kw in MODES:
                def ours(i, ls=ls, kw=kw, res=res, offset=offset):
                    return sample_tokens(ls[i], seed=1234, offset=offset, out=res, **kw)

                def comp(i, ls=ls, kw=kw):
                    x = ls[i]
                    if kw["temperature"] == 0.0:
                        return x.argmax(1)
                    x = x / kw["temperature"]
                    if kw.get("top_k"):
                        kth = cp.partition(x, x.shape[1] - kw["top_k"], axis=1)[:, -kw["top_k"]][:, None]
                        x = cp.where(x >= kth, x, -cp.inf)
                    p = cp.exp(x - x.max(1, keepdims=True))
                    if kw.get("top_p"):
                        srt = -cp.sort(-p, axis=1)
                        c = cp.cumsum(srt, 1)
                        cut = srt[cp.arange(x.shape[0]), (c < kw["top_p"] * c[:, -1:]).sum(1)][:, None]
                        p = cp.where(p >= cut, p, 0)
                    c = cp.cumsum(p, 1)
                    u = cp.random.random_sample((x.shape[0], 1), dtype=cp.float32) * c[:, -1:]
                    return (c <= u).sum(1)

                tf = None
                if torch is not None:
                    tl = [ctx.t(x) for x in ls]

                    def tf(i, tl=tl, kw=kw):
                        x = tl[i]
                        if kw["temperature"] == 0.0:
                            return x.argmax(1)
                        x = x / kw["temperature"]
                        if kw.get("top_k"):
                            v, _ = torch.topk(x, kw["top_k"])
                            x = x.masked_fill(x < v[:, -1:], float("-inf"))
                        if kw.get("top_p"):
                            srt, idx = torch.sort(x, descending=False)
                            cp_ = srt.softmax(-1).cumsum(-1)
                            rem = (cp_ <= 1 - kw["top_p"]).scatter(1, idx, cp_ <= 1 - kw["top_p"])
                            x = x.masked_fill(rem, float("-inf"))
                        return torch.multinomial(x.softmax(-1), 1)

                out.append(Case(f"sample_tokens {name}", f"B{Bsz}x{V}", "f32", Bsz * V * 4, "B*V*4 (one read)",
                                ours, comp, tf, extra=dict(nsets=k_)))
    return out
