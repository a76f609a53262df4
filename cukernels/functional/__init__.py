"""The differentiable functional API: autograd Functions over plain array operations (:mod:`.array_ops`) and one
per kernel family (:mod:`.kernel_ops`). Importing this package also gives :class:`cukernels.Tensor` its
operators and array methods (``+ - * / ** @``, indexing, ``.T``, ``exp``, ``sum``, ``reshape``, ...), so that
``autograd`` itself imports nothing above the ops.
"""
from __future__ import annotations

import numpy as np

from ..autograd import Tensor
from . import array_ops, kernel_ops, loss_ops, norm_ops
from .array_ops import (Add, Cast, Concat, Contiguous, Div, Erf, Exp, GetItem, Linear, Log, MaskedFill, Matmul, Mul,
                        PackedLinear, PickLast, Pow, PowScalar, Reshape, Rsqrt, Sigmoid, Sub, Sum, Take, Tanh, Transpose,
                        add, cast, concat, contiguous, div, erf, exp, gemm, getitem, joined_rows, linear, log,
                        masked_fill, matmul, mean, mul, packed_linear, pow, reshape, rsqrt, sigmoid, silu, sub, sum,
                        tanh, transpose)
from .kernel_ops import (AttnSoftmaxF, CrossEntropyF, DropoutAddF, DropoutF, EmbeddingF, EmbeddingLowpF, FlashAttentionF,
                         FlashAttentionPackedF, GeluF, LayerNormF,
                         RMSNormF, RopeF, SoftmaxF, SparseEmbeddingF, SwiGLUF, SwiGLUPackedF, attn_softmax,
                         cross_entropy, dropout, dropout_add, embedding, flash_attention,
                         flash_attention_packed, gelu, layer_norm, rms_norm, rope, rotate_half,
                         softmax, swiglu, swiglu_packed)
from .loss_ops import LinearCrossEntropyF, linear_cross_entropy, linear_cross_entropy_ok
from .norm_ops import AddRMSNormF, PickF, add_rms_norm


def _shape_args(shape):
    return shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape


def _install():
    T = Tensor
    T.__add__ = lambda self, o: add(self, o)
    T.__radd__ = lambda self, o: add(o, self)
    T.__sub__ = lambda self, o: sub(self, o)
    T.__rsub__ = lambda self, o: sub(o, self)
    T.__mul__ = lambda self, o: mul(self, o)
    T.__rmul__ = lambda self, o: mul(o, self)
    T.__truediv__ = lambda self, o: div(self, o)
    T.__rtruediv__ = lambda self, o: div(o, self)
    T.__neg__ = lambda self: mul(self, -1.0)
    T.__pow__ = lambda self, p: pow(self, p)
    T.__rpow__ = lambda self, o: array_ops.Pow.apply(o, self)  # number ** Tensor: the exponent differentiated
    T.__matmul__ = lambda self, o: matmul(self, o)
    T.__getitem__ = lambda self, idx: getitem(self, idx)
    T.reshape = lambda self, *shape: reshape(self, _shape_args(shape))
    T.transpose = lambda self, *axes: transpose(self, _shape_args(axes) if axes else None)
    T.T = property(lambda self: transpose(self, None))
    T.sum = lambda self, axis=None, keepdims=False: sum(self, axis, keepdims)
    T.mean = lambda self, axis=None, keepdims=False: mean(self, axis, keepdims)
    T.exp = lambda self: exp(self)
    T.log = lambda self: log(self)
    T.tanh = lambda self: tanh(self)
    T.sigmoid = lambda self: sigmoid(self)
    T.astype = lambda self, dtype: cast(self, dtype)
    T.contiguous = lambda self: contiguous(self)


_install()

__all__ = [n for n in dir() if not n.startswith("_") and n not in ("np", "annotations")]
