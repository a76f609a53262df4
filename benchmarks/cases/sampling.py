"""Benchmark cases for sample_tokens (kernels_cu/sampling.cu): greedy, top-k 50, top-p 0.9 at B 1 / 8 / 64 over
LLaMA-3's and GPT-2's vocabularies, fp32 logits (the LM head's output).

Bytes: the logits read once (B * V * 4); the kernel makes 2 (greedy: 1) to ~8 passes over a row, the later ones
from L2, so GB/s here is a lower bound of the traffic. Sampling runs one block per row: at B = 1 a single SM does
the work, so the figure to read is the time. Greedy splits a row over ~8 KB slices (63 blocks at fp32 V = 128256)
and launches under PDL inside pdl_scope(); its A/B rows (session 5): "1-block" (ck.settings.greedy_split off: the
one-block-per-row kernel, 29.8 us in the decode profile), "no-PDL", slices of 4 / 16 KB, and the repetition penalty on
(512-token history) split vs 1-block. "x cupy": argmax / sort-based composites in CuPy; "x torch": argmax,
topk + softmax + multinomial, sort + cumsum + multinomial (what transformers' samplers run).
"""
import contextlib

import numpy as np

from bench_ops import Case
from cukernels import settings
from cukernels.ops import _launch
from cukernels.ops import sampling as S_
from cukernels.ops.sampling import sample_tokens, sample_workspace


GREEDY_VARIANTS = [  # (label, ck.settings for the call (read at launch time: a captured call keeps them), pdl scope)
    ("", {}, True), (" 1-block", dict(greedy_split=False), True), (" no-PDL", {}, False),
    (" 4KB slices", dict(greedy_slice_bytes=4096), True), (" 16KB slices", dict(greedy_slice_bytes=16384), True),
]


def greedy_cases(ctx, out):
    cp = ctx.cp
    ws = sample_workspace()
    for V in ((128256,) if ctx.quick else (128256, 50257)):
        for Bsz in (1, 8):
            k_ = ctx.nsets(Bsz * V * 4)
            ls = [cp.random.standard_normal((Bsz, V), dtype=cp.float32) for _ in range(k_)]
            res = cp.empty((Bsz,), dtype=cp.int32)
            hist = cp.random.randint(0, V, (Bsz, 512)).astype(cp.int32)
            variants = GREEDY_VARIANTS if V == 128256 else GREEDY_VARIANTS[:2]
            pen = [(" penalty", dict(repetition_penalty=1.3, prev_tokens=hist), {}),
                   (" penalty 1-block", dict(repetition_penalty=1.3, prev_tokens=hist), dict(greedy_split=False))]
            for label, kw, flags, pdl in [(lb, {}, fl, p) for lb, fl, p in variants] + [(a, b, c, True)
                                                                                       for a, b, c in pen]:
                def ours(i, ls=ls, res=res, kw=kw, flags=flags, pdl=pdl):
                    with settings(**flags), (_launch.pdl_scope() if pdl else contextlib.nullcontext()):
                        return sample_tokens(ls[i], temperature=0.0, out=res, workspace=ws, **kw)

                splits = 1 if flags.get("greedy_split") is False else S_.greedy_splits(
                    Bsz, V, 4, flags.get("greedy_slice_bytes"))
                comp = (lambda i, ls=ls: ls[i].argmax(1)) if not label else None
                tf = None
                if ctx.torch is not None and not label:
                    tl = [ctx.t(x) for x in ls]
                    tf = (lambda i, tl=tl: tl[i].argmax(1))
                out.append(Case(f"sample_tokens greedy{label}", f"B{Bsz}x{V}", "f32", Bsz * V * 4,
                                "B*V*4 (one read)", ours, comp, tf, note=f"{splits} blocks/row",
                                extra=dict(nsets=k_)))


MODES = [("greedy", dict(temperature=0.0)), ("top-k 50", dict(temperature=0.8, top_k=50)),
         ("top-p 0.9", dict(temperature=0.8, top_p=0.9))]


def cases(ctx):
    cp, torch = ctx.cp, ctx.torch
    out = []
    greedy_cases(ctx, out)
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
                if kw["temperature"] == 0.0 and Bsz in (1, 8):
                    continue  # greedy_cases has these rows (and their A/B variants)
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
