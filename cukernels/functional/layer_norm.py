"""LayerNorm as an autograd Function: :func:`layer_norm` (``LayerNormF`` over ``ck.layer_norm`` /
``ck.layer_norm_backward``): ops/layer_norm.py, kernels_cu/layer_norm.cu.
"""
from __future__ import annotations

import numpy as np

from .. import _backend as B
from ..autograd import Function
from ..ops.layer_norm import layer_norm as _ln, layer_norm_backward as _ln_bwd
from .array_ops import _composite_norm_args, _contig, _data, add, cast, mean, mul, pow, rsqrt, sub


class LayerNormF(Function):
    @staticmethod
    def forward(ctx, x, gamma, beta, eps):
        y, mean, rstd = _ln(x, gamma, beta, eps, return_stats=True)
        ctx.save_for_backward(x, gamma, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, g):
        x, gamma, mean, rstd = ctx.saved_tensors
        dx, dgamma, dbeta = _ln_bwd(_contig(g, x.dtype), x, gamma, mean, rstd)
        return dx, dgamma, dbeta, None


def layer_norm(x, gamma, beta, eps=1e-5, fused=True):
    if fused:
        return LayerNormF.apply(x, gamma, beta, eps)
    _composite_norm_args(x, eps, gamma=gamma, beta=beta)
    dt = _data(x).dtype
    xf = cast(x, np.float32) if dt == B.bfloat16 else x
    c = sub(xf, mean(xf, axis=-1, keepdims=True))
    r = rsqrt(add(mean(pow(c, 2), axis=-1, keepdims=True), eps))
    ft = _data(xf).dtype
    return cast(add(mul(mul(c, r), cast(gamma, ft)), cast(beta, ft)), dt)


__all__ = ['LayerNormF', 'layer_norm']
