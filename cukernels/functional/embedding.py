"""Embedding lookups as autograd Functions: :func:`embedding` (``EmbeddingF``, ``EmbeddingLowpF``: ``ck.embedding`` /
``ck.embedding_backward``; ``SparseEmbeddingF``: the gradient as a ``ck.SparseRowGrad``): ops/embedding.py,
kernels_cu/embedding.cu.
"""
from __future__ import annotations

import numpy as np

from ..autograd import Function, Tensor, _xp
from ..ops.embedding import SparseRowGrad, embedding as _emb, embedding_backward as _emb_bwd
from ..ops.embedding import embedding_error as _emb_error
from .array_ops import Take, _composite_rows, _contig, _data, cast


class EmbeddingF(Function):
    """``table[ids]`` through ``ck.embedding``; dense gradient through ``ck.embedding_backward``, accumulated
    straight into the table's ``.grad`` buffer when it has one."""

    @staticmethod
    def forward(ctx, table, ids):
        ctx.save_for_backward(ids)
        ctx.V = table.shape[0]
        return _emb(ids, table)

    @staticmethod
    def backward(ctx, g):
        (ids,) = ctx.saved_tensors
        g = _contig(g)
        buf, acc = ctx.leaf_grad_write(0)
        if buf is not None:
            _emb_bwd(ids, g, ctx.V, out=buf, accumulate=acc)
            return None, None
        return _emb_bwd(ids, g, ctx.V), None


class SparseEmbeddingF(Function):
    """As EmbeddingF, but the gradient goes to ``table_tensor.sparse_grad`` (a ``ck.SparseRowGrad``: only the
    rows seen are touched, and the optimizer updates only those rows). ``table_lowp`` is an optional array
    read instead of the table (the bf16 shadow under autocast)."""

    @staticmethod
    def forward(ctx, table, ids, sparse_grad, table_lowp=None):
        ctx.save_for_backward(ids)
        ctx.sg = sparse_grad
        return _emb(ids, table if table_lowp is None else table_lowp)

    @staticmethod
    def backward(ctx, g):
        (ids,) = ctx.saved_tensors
        ctx.sg.accumulate(ids, _contig(g))
        return None, None, None, None


class EmbeddingLowpF(Function):
    """Dense embedding reading a low-precision copy of the table (the shadow) with the gradient to the table."""

    @staticmethod
    def forward(ctx, table, ids, table_lowp):
        ctx.save_for_backward(ids)
        ctx.V = table.shape[0]
        return _emb(ids, table_lowp)

    @staticmethod
    def backward(ctx, g):
        gt, _ = EmbeddingF.backward(ctx, g)
        return gt, None, None


def embedding(table, ids, *, fused=True, table_lowp=None, sparse=False):
    """Rows of ``table`` [V, D] at int ids; gradient dense (into table.grad) or sparse-row
    (into table.sparse_grad, a ck.SparseRowGrad)."""
    ids = _data(ids)
    if not fused:
        ids = _composite_rows("ids", ids, _data(table).shape[0], _xp(_data(table)),
                              None if _xp(_data(table)) is np else _emb_error())
        out = Take.apply(table, ids)
        return cast(out, table_lowp.dtype) if table_lowp is not None else out
    if sparse and isinstance(table, Tensor) and table.requires_grad:
        if table.sparse_grad is None:
            table.sparse_grad = _new_sparse_grad(table)
        return SparseEmbeddingF.apply(table, ids, table.sparse_grad, table_lowp)
    if table_lowp is not None:
        return EmbeddingLowpF.apply(table, ids, table_lowp)
    return EmbeddingF.apply(table, ids)


def _new_sparse_grad(table):
    return SparseRowGrad(table.shape[0], table.shape[1])


__all__ = ['EmbeddingF', 'SparseEmbeddingF', 'EmbeddingLowpF', 'embedding']
