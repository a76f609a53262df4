"""The differentiable functional API: autograd Functions over plain array operations (:mod:`.array_ops`) and, one
module per kernel family mirroring ``cukernels/ops/`` (``rms_norm``, ``layer_norm``, ``softmax``, ``attention``,
``cross_entropy``, ``linear_cross_entropy``, ``embedding``, ``rope``, ``activations``, ``dropout``), a Function per
kernel op and the functional entry point the layers call. The names here are each module's ``__all__``.

Each Function's forward calls ``ck.<op>`` and its backward ``ck.<op>_backward`` (on NumPy arrays these run the
ops' reference paths, so both are checked on the CPU). Each functional entry point takes ``fused``: True runs
the Function, False the composite of plain array Functions (:mod:`.array_ops`) with the same math, so a kernel's
gain can be measured and its gradient cross-checked.

A family module and its function share a name: ``F.rms_norm`` is the function; import from the module by its path
(``from cukernels.functional.rms_norm import RMSNormF``). Importing this package also gives :class:`cukernels.Tensor`
its operators and array methods (``+ - * / ** @``, indexing, ``.T``, ``exp``, ``sum``, ``reshape``, ...), so that
``autograd`` itself imports nothing above the ops.
"""
from __future__ import annotations

from .._public import reexport as _reexport
from ..autograd import Tensor
from .array_ops import (Pow, add, cast, contiguous, div, exp, getitem, log, matmul, mean, mul, pow, reshape,  # _install
                        sigmoid, sub, sum, tanh, transpose)

__all__ = ["Tensor"] + _reexport(__name__, globals())  # every functional/<family>.py's __all__, array_ops' too


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
    T.__rpow__ = lambda self, o: Pow.apply(o, self)  # number ** Tensor: the exponent differentiated
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

