"""Dropout as autograd Functions: :func:`dropout` (``DropoutF``: ``ck.dropout``, the mask drawn again from (seed,
offset) in the backward) and :func:`dropout_add` (``DropoutAddF``: ``ck.dropout_add``): ops/dropout.py,
kernels_cu/dropout.cu.
"""
from __future__ import annotations

import numpy as np

from ..autograd import Function
from ..ops.dropout import dropout as _drop, dropout_add as _drop_add, dropout_backward as _drop_bwd
from ..ops.dropout import keep_mask as _keep_mask
from .array_ops import _contig, _data, add, mul


class DropoutF(Function):
    """Inverted dropout (ck.dropout); the backward draws the same mask again from (seed, offset)."""

    @staticmethod
    def forward(ctx, x, p, seed, offset):
        ctx.rng = (p, seed, offset)
        return _drop(x, p, seed=seed, offset=offset)

    @staticmethod
    def backward(ctx, g):
        p, seed, offset = ctx.rng
        return _drop_bwd(_contig(g), p, seed=seed, offset=offset), None, None, None


class DropoutAddF(Function):
    """``residual + dropout(x)`` in one kernel (ck.dropout_add): GPT-2's residual branch."""

    @staticmethod
    def forward(ctx, x, residual, p, seed, offset):
        ctx.rng = (p, seed, offset)
        ctx.xdt = x.dtype
        return _drop_add(x, _contig(residual), p, seed=seed, offset=offset)

    @staticmethod
    def backward(ctx, g):
        p, seed, offset = ctx.rng
        g = _contig(g)
        dx = _drop_bwd(g, p, seed=seed, offset=offset, dtype=ctx.xdt) if ctx.needs_input_grad[0] else None
        return dx, g, None, None, None


def dropout(x, p, *, seed, offset, training=True):
    """Inverted dropout with a counter-based mask (ck.dropout): ``seed`` per site, ``offset`` per forward pass
    (ints or 0-d device arrays: a captured step that advances the offset draws fresh masks). Identity when not
    training or p == 0."""
    if not training or not p:
        return x
    if _data(x).dtype == np.float64:  # gradient checks on the NumPy path: the same mask, as a constant product
        return mul(x, _mask64(x, p, seed, offset))
    return DropoutF.apply(x, p, seed, offset)


def _mask64(x, p, seed, offset):
    keep = _keep_mask(_data(x).shape, p, seed=int(seed), offset=int(offset))
    return keep.astype(np.float64) / (1.0 - p)


def dropout_add(x, residual, p, *, seed, offset, training=True):
    """``residual + dropout(x)`` (one kernel when training with p > 0, else a plain add)."""
    if not training or not p:
        return add(residual, x)
    if _data(x).dtype == np.float64:
        return add(residual, mul(x, _mask64(x, p, seed, offset)))
    return DropoutAddF.apply(x, residual, p, seed, offset)


__all__ = ['DropoutF', 'DropoutAddF', 'dropout', 'dropout_add']
