"""The rotary embedding as an autograd Function: :func:`rope` (``RopeF``: ``ck.rope`` / ``ck.rope_backward``,
rotate-half layout): ops/rope.py, kernels_cu/rope.cu.
"""
from __future__ import annotations

import numpy as np

from .. import _backend as B
from ..autograd import Function, _xp
from ..ops.rope import rope as _rope, rope_backward as _rope_bwd
from .array_ops import _composite_rows, _contig, _data, add, cast, concat, getitem, mul


class RopeF(Function):
    @staticmethod
    def forward(ctx, x, cos, sin, positions=None):
        ctx.save_for_backward(cos, sin, positions)
        return _rope(x, cos, sin, positions=positions)

    @staticmethod
    def backward(ctx, g):
        cos, sin, positions = ctx.saved_tensors
        return _rope_bwd(_contig(g), cos, sin, positions=positions), None, None, None


def rotate_half(x):
    D = _data(x).shape[-1]
    return concat([mul(getitem(x, (Ellipsis, slice(D // 2, None))), -1.0),
                   getitem(x, (Ellipsis, slice(0, D // 2)))], axis=-1)


def rope(x, cos, sin, *, positions=None, fused=True):
    """Rotary embedding on [B, T, H, D] (HF rotate-half layout) with fp32 cos/sin [>=T, D/2]."""
    if fused:
        return RopeF.apply(x, cos, sin, positions)
    xd = _data(x)
    xp, T = _xp(xd), xd.shape[1]
    if positions is not None:  # (the kernel clamps positions into the table; the reference raises)
        positions = _composite_rows("positions", positions, cos.shape[0], xp, None)
    elif T > cos.shape[0]:
        raise ValueError(f"cos: has {cos.shape[0]} positions but x has seq = {T} (pass a longer cache, or positions=)")
    c = cos[positions] if positions is not None else cos[:T]
    s = sin[positions] if positions is not None else sin[:T]
    c = xp.concatenate([c, c], axis=-1)
    s = xp.concatenate([s, s], axis=-1)
    c = (c[:, :, None, :] if c.ndim == 3 else c[None, :, None, :])
    s = (s[:, :, None, :] if s.ndim == 3 else s[None, :, None, :])
    dt = xd.dtype
    xf = cast(x, np.float32) if dt == B.bfloat16 else x
    ft = _data(xf).dtype
    return cast(add(mul(xf, c.astype(ft)), mul(rotate_half(xf), s.astype(ft))), dt)


__all__ = ['RopeF', 'rope', 'rotate_half']
