"""Activations as autograd Functions: :func:`swiglu` / :func:`swiglu_packed` (``SwiGLUF``, ``SwiGLUPackedF``:
``ck.swiglu``, ``ck.swiglu_packed``) and :func:`gelu` (``GeluF``: ``ck.gelu``, tanh or exact): ops/activations.py,
kernels_cu/activations.cu.
"""
from __future__ import annotations

import numpy as np

from ..autograd import Function
from ..ops.activations import gelu as _gelu, gelu_backward as _gelu_bwd
from ..ops.activations import swiglu as _swiglu, swiglu_backward as _swiglu_bwd
from ..ops.activations import swiglu_packed as _swiglu_p, swiglu_packed_backward as _swiglu_p_bwd
from .array_ops import _contig, _data, add, erf, getitem, mul, pow, silu, tanh


class SwiGLUF(Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _swiglu(gate, up)

    @staticmethod
    def backward(ctx, g):
        gate, up = ctx.saved_tensors
        return _swiglu_bwd(gate, up, _contig(g, gate.dtype))


class SwiGLUPackedF(Function):
    @staticmethod
    def forward(ctx, gu):
        ctx.save_for_backward(gu)
        return _swiglu_p(gu)

    @staticmethod
    def backward(ctx, g):
        (gu,) = ctx.saved_tensors
        return _swiglu_p_bwd(gu, _contig(g, gu.dtype))


class GeluF(Function):
    """ck.gelu: the tanh approximation or the exact erf form (``approximate="none"``)."""

    @staticmethod
    def forward(ctx, x, approximate="tanh"):
        ctx.save_for_backward(x)
        ctx.approximate = approximate
        return _gelu(x, approximate=approximate)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return _gelu_bwd(x, _contig(g, x.dtype), approximate=ctx.approximate), None


def swiglu(gate, up, fused=True):
    """``silu(gate) * up``."""
    if fused:
        return SwiGLUF.apply(gate, up)
    if tuple(_data(up).shape) != tuple(_data(gate).shape):  # (broadcast silently, or NumPy's message)
        raise ValueError(f"up: expected shape {tuple(_data(gate).shape)} (the shape of gate); got "
                         f"{tuple(_data(up).shape)}")
    return mul(silu(gate), up)


def swiglu_packed(gu, fused=True):
    """``silu(gu[..., :F]) * gu[..., F:]`` for gu [..., 2F]."""
    if fused:
        return SwiGLUPackedF.apply(gu)
    F2 = _data(gu).shape[-1]
    return swiglu(getitem(gu, (Ellipsis, slice(0, F2 // 2))), getitem(gu, (Ellipsis, slice(F2 // 2, None))),
                  fused=False)


def gelu(x, fused=True, approximate="tanh"):
    """GELU. ``approximate="tanh"`` (GPT-2's "gelu_new"): ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``;
    ``"none"``: the exact ``0.5 x (1 + erf(x / sqrt(2)))``. Fused: the ck.gelu kernels (both forms); composite:
    array ops (float64 inputs, gradient checks, take this path for the exact form too)."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"approximate: expected 'tanh' or 'none'; got {approximate!r}")
    if fused and not (approximate == "none" and _data(x).dtype == np.float64):
        return GeluF.apply(x, approximate)
    if approximate == "none":
        return mul(mul(x, 0.5), add(erf(mul(x, float(1 / np.sqrt(2.0)))), 1.0))
    c = float(np.sqrt(2.0 / np.pi))
    inner = mul(add(x, mul(pow(x, 3), 0.044715)), c)
    return mul(mul(x, 0.5), add(tanh(inner), 1.0))


__all__ = ['SwiGLUF', 'SwiGLUPackedF', 'GeluF', 'swiglu', 'swiglu_packed', 'gelu']
