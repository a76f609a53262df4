"""Token cross-entropy as an autograd Function: :func:`cross_entropy` (``CrossEntropyF``: ``ck.cross_entropy_fused``,
or ``ck.cross_entropy`` + ``ck.cross_entropy_backward``): ops/cross_entropy.py, kernels_cu/cross_entropy.cu.
"""
from __future__ import annotations

import numpy as np

from .. import _backend as B
from ..autograd import Function, _xp
from ..ops.cross_entropy import _host_check_targets as _ce_host_check_targets
from ..ops.cross_entropy import check_options as _ce_options, cross_entropy_error as _ce_error
from ..ops.cross_entropy import cross_entropy as _ce, cross_entropy_backward as _ce_bwd
from ..ops.cross_entropy import cross_entropy_fused as _ce_fused
from .array_ops import PickLast, _data, add, cast, exp, log, mul, reshape, sub, sum


class CrossEntropyF(Function):
    """Mean (or sum) token cross-entropy of [N, V] logits; a 0-d fp32 device loss.

    When a gradient is wanted, the forward runs ``ck.cross_entropy_fused`` (loss and dlogits in one pass over
    the logits; with ``inplace=True`` dlogits overwrite the logits, which nothing else keeps) and the backward
    hands dlogits on as they are when the incoming gradient is the implicit 1 of ``loss.backward()``, scaled
    by it otherwise. ``fused_backward=False`` uses ``cross_entropy`` + ``cross_entropy_backward`` instead.
    """

    @staticmethod
    def forward(ctx, logits, targets, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                inplace=False, fused_backward=True):
        kw = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
        ctx.kw = kw
        if not ctx.needs_input_grad[0]:
            return _ce(logits, targets, **kw)
        if fused_backward:
            loss, dlogits = _ce_fused(logits, targets, **kw, out=logits if inplace else None)
            ctx.save_for_backward(dlogits)
            ctx.fused = True
            return loss
        loss, lse = _ce(logits, targets, **kw, return_lse=True)
        ctx.save_for_backward(logits, targets, lse)
        ctx.fused = False
        return loss

    @staticmethod
    def backward(ctx, g):
        if ctx.fused:
            (dlogits,) = ctx.saved_tensors
            if not ctx.seed_one:
                xp = _xp(dlogits)
                xp.multiply(dlogits, g.astype(np.float32), out=dlogits, casting="unsafe")
            return (dlogits,) + (None,) * 6
        logits, targets, lse = ctx.saved_tensors
        dl = _ce_bwd(logits, targets, lse, g, **ctx.kw)
        return (dl,) + (None,) * 6


def cross_entropy(logits, targets, *, ignore_index=-100, reduction="mean", label_smoothing=0.0, fused=True,
                  inplace=False, fused_backward=True):
    """Token cross-entropy of [N, V] logits against int targets [N]; a 0-d fp32 loss. Targets equal to
    ignore_index count for nothing; "mean" divides by the number of the others."""
    if B.check_bool("fused", fused):
        return CrossEntropyF.apply(logits, targets, ignore_index, reduction, label_smoothing, inplace,
                                   fused_backward)
    # The composite path validates as the kernels do (ops.cross_entropy.check_options: reduction, ignore_index,
    # label_smoothing in [0, 1]), and treats a target outside [0, V) that is not ignore_index as they do: an
    # error on the NumPy path; on CuPy the row counts as ignored and the cross-entropy error word is set
    # (a device-side flag: no host read).
    ig, _ = _ce_options(ignore_index, reduction, label_smoothing)
    x0, t = _data(logits), _data(targets)
    xp = B.array_module(logits=x0, targets=t)
    if not (x0.dtype.kind == "f" or x0.dtype == B.bfloat16) or x0.ndim < 1 or x0.shape[-1] < 1:
        raise TypeError(f"logits: expected a float array [..., V] with V >= 1; got {x0.dtype} {tuple(x0.shape)}")
    B.check_dtype("targets", t, (np.int32, np.int64))
    B.check_shape("targets", t, x0.shape[:-1], " (logits.shape[:-1])")
    V = x0.shape[-1]
    x = cast(logits, np.float32) if x0.dtype == B.bfloat16 else logits
    m = _data(x).max(axis=-1, keepdims=True)
    z = sub(x, m)
    lse = log(sum(exp(z), axis=-1, keepdims=True))
    valid = t != ig
    if xp is np:
        _ce_host_check_targets(t, V, ig)
    else:
        bad = valid & ((t < 0) | (t >= V))
        err = _ce_error()
        xp.bitwise_or(err, bad.any().astype(np.int32), out=err)
        valid = valid & ~bad
    nll = sub(reshape(lse, t.shape), PickLast.apply(z, xp.where(valid, t, 0)))
    if label_smoothing:
        smooth = sub(reshape(lse, t.shape), mul(sum(z, axis=-1), 1.0 / V))
        nll = add(mul(nll, 1.0 - label_smoothing), mul(smooth, label_smoothing))
    ft = _data(x).dtype
    per_row = mul(nll, valid.astype(ft))
    if reduction == "none":
        return per_row
    tot = sum(per_row)
    if reduction == "sum":
        return tot
    return mul(tot, (1.0 / xp.maximum(valid.sum(), 1)).astype(ft))


__all__ = ['CrossEntropyF', 'cross_entropy']
