"""Softmax as autograd Functions: :func:`softmax` (``SoftmaxF``: ``ck.softmax``) and the attention-score softmax
:func:`attn_softmax` (``AttnSoftmaxF``: ``ck.attn_softmax``, scale + causal / sliding-window / key masks):
ops/softmax.py, kernels_cu/softmax.cu.
"""
from __future__ import annotations

import numpy as np

from .. import _backend as B
from ..autograd import Function, _xp
from ..ops.softmax import attn_softmax as _attn_sm, attn_softmax_backward as _attn_sm_bwd
from ..ops.softmax import softmax as _sm, softmax_backward as _sm_bwd
from .array_ops import _contig, _data, add, cast, div, exp, masked_fill, mul, sub, sum


class SoftmaxF(Function):
    @staticmethod
    def forward(ctx, x):
        y = _sm(x, axis=-1)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return _sm_bwd(y, _contig(g, y.dtype))


class AttnSoftmaxF(Function):
    """``softmax(scale * scores + mask)`` over the last axis of [B, H, Tq, Tk] scores (ck.attn_softmax). The
    backward needs nothing of the masks: keys they (or the causal diagonal, or the window) drop have probs 0, so
    ``dscores = scale * p * (g - sum(g * p))`` is 0 there."""

    @staticmethod
    def forward(ctx, scores, key_mask=None, causal=False, scale=1.0, window=None):
        p = _attn_sm(scores, key_mask=key_mask, causal=causal, scale=scale, window=window)
        ctx.save_for_backward(p)
        ctx.scale = scale
        return p

    @staticmethod
    def backward(ctx, g):
        (p,) = ctx.saved_tensors
        return _attn_sm_bwd(p, _contig(g, p.dtype), scale=ctx.scale), None, None, None, None


def softmax(x, fused=True):
    """Softmax over the last axis. fused -> ck.softmax; else max/exp/sum (max held constant: exact)."""
    if fused:
        return SoftmaxF.apply(x)
    dt = _data(x).dtype
    xf = cast(x, np.float32) if dt == B.bfloat16 else x
    m = _data(xf).max(axis=-1, keepdims=True)
    e = exp(sub(xf, m))
    return cast(div(e, sum(e, axis=-1, keepdims=True)), dt)


def attn_softmax(scores, *, causal=False, scale=1.0, key_mask=None, window=None, fused=True):
    """softmax(scale * scores) over [B, H, Tq, Tk] with a causal mask aligned at the end (query i sees keys
    <= i + Tk - Tq), with ``window`` W (causal only) also only keys > i + Tk - Tq - W (at most W keys, itself
    included), and an optional boolean key mask [B, Tk] (True = keep). Fully masked rows give zeros."""
    if fused:
        return AttnSoftmaxF.apply(scores, key_mask, causal, scale, window)
    s = _data(scores)
    xp, (Tq, Tk) = _xp(s), s.shape[-2:]
    dt = s.dtype
    window = B.check_window(window, causal)
    x = mul(cast(scores, np.float32) if dt == B.bfloat16 else scores, scale)
    drop = None
    if causal:
        pos = xp.arange(Tq)[:, None] + (Tk - Tq)
        drop = xp.arange(Tk)[None, :] > pos
        if window is not None:
            drop = drop | (pos - xp.arange(Tk)[None, :] >= window)
    if key_mask is not None:
        km = ~key_mask.astype(bool)[:, None, None, :]
        drop = km if drop is None else (drop | km)
    if drop is None:
        return cast(softmax(x, fused=False), dt)
    x = masked_fill(x, drop, -np.inf)
    xd = _data(x)
    m = xd.max(axis=-1, keepdims=True)
    m = xp.where(xp.isfinite(m), m, 0).astype(xd.dtype)
    e = exp(sub(x, m))
    ssum = _data(e).sum(axis=-1, keepdims=True)
    den = add(sum(e, axis=-1, keepdims=True), (ssum == 0).astype(xd.dtype))  # fully masked rows -> 0
    return cast(div(e, den), dt)


__all__ = ['SoftmaxF', 'AttnSoftmaxF', 'softmax', 'attn_softmax']
