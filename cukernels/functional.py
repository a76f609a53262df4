"""Autograd Functions and the functional API the layers are built from.

Two kinds of Function:

* plain array operations (add, mul, exp, sum, matmul, reshape, ...): the ``fused=False`` composite path of
  every layer is a tape of these, so its forward and backward are ordinary CuPy/NumPy operations;
* one Function per kernel family (rms_norm, layer_norm, softmax / attn_softmax, cross_entropy, embedding
  (dense and sparse-row), rope, swiglu, gelu): forward calls ``ck.<op>``, backward calls ``ck.<op>_backward``.
  On NumPy arrays these run the ops' reference paths, so both are checked on the CPU.

Every GEMM goes through :func:`gemm` (one place to swap in another cuBLAS path).
"""
from __future__ import annotations

import numpy as np

from . import _backend as B
from .autograd import Function, Tensor, _xp, fast_add, is_grad_enabled

_FLOAT_KINDS = "fc"


def _ck():
    import cukernels
    return cukernels


def _data(a):
    return a.data if isinstance(a, Tensor) else a


def _contig(g, dtype=None):
    xp = _xp(g)
    if dtype is not None and g.dtype != dtype:
        g = g.astype(dtype)
    return xp.ascontiguousarray(g)


def _unbroadcast(g, shape):
    shape = tuple(shape)
    if tuple(g.shape) == shape:
        return g
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(i + lead for i, s in enumerate(shape) if s == 1 and g.shape[i + lead] != 1)
    return g.sum(axis=axes, keepdims=True).reshape(shape) if axes else g.reshape(shape)


def _shape(a):
    return tuple(a.shape) if hasattr(a, "shape") else ()


# ================================================================================================ GEMM
def gemm(a, b, *, trans_a=False, trans_b=False, out=None, accumulate=False):
    """``op(a) @ op(b)``, batched over equal leading axes (or one operand 2-D), ``op`` transposing the last two
    axes when asked; no transpose is materialised.

    The single place where the autograd issues matrix products, through ``ck.matmul`` (cuBLAS GemmEx on our
    own graph-capturable handle; bf16 inputs accumulate in fp32; NumPy reference on the CPU, float64 kept).
    With ``out`` the product is written into it, or -- ``accumulate=True``, the weight-gradient case -- added
    to it with beta = 1: bf16 operands accumulate straight into the fp32 ``.grad`` buffer.
    """
    ck = _ck()
    xp = _xp(a)
    a, b = xp.ascontiguousarray(a), xp.ascontiguousarray(b)
    if b.dtype != a.dtype:
        b = b.astype(a.dtype)
    if out is None:
        return ck.matmul(a, b, trans_a=trans_a, trans_b=trans_b)
    direct = out.flags.c_contiguous and (out.dtype == a.dtype or (out.dtype == np.float32 and a.dtype == B.bfloat16))
    if direct:
        return ck.matmul(a, b, trans_a=trans_a, trans_b=trans_b, out=out, beta=1.0 if accumulate else 0.0)
    r = ck.matmul(a, b, trans_a=trans_a, trans_b=trans_b)
    if accumulate:
        out += r
    else:
        out[...] = r
    return out


# ======================================================================================= elementwise
class Add(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.shapes = (_shape(a), _shape(b))
        if hasattr(a, "shape") and hasattr(b, "shape"):
            return fast_add(a, b)  # the residual adds: ck.add on CuPy
        return a + b

    @staticmethod
    def backward(ctx, g):
        sa, sb = ctx.shapes
        return _unbroadcast(g, sa), _unbroadcast(g, sb)


class Sub(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.shapes = (_shape(a), _shape(b))
        return a - b

    @staticmethod
    def backward(ctx, g):
        sa, sb = ctx.shapes
        return _unbroadcast(g, sa), _unbroadcast(-g, sb)


class Mul(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        ga = _unbroadcast(g * b, _shape(a)) if ctx.needs_input_grad[0] else None
        gb = _unbroadcast(g * a, _shape(b)) if ctx.needs_input_grad[1] else None
        return ga, gb


class Div(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a / b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        ga = _unbroadcast(g / b, _shape(a)) if ctx.needs_input_grad[0] else None
        gb = _unbroadcast(-g * a / (b * b), _shape(b)) if ctx.needs_input_grad[1] else None
        return ga, gb


class PowScalar(Function):
    @staticmethod
    def forward(ctx, x, p):
        ctx.save_for_backward(x)
        ctx.p = p
        return x ** p

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (ctx.p * x ** (ctx.p - 1)), None


class Exp(Function):
    @staticmethod
    def forward(ctx, x):
        y = _xp(x).exp(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        return g * ctx.saved_tensors[0]


class Log(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return _xp(x).log(x)

    @staticmethod
    def backward(ctx, g):
        return g / ctx.saved_tensors[0]


class Rsqrt(Function):
    @staticmethod
    def forward(ctx, x):
        y = 1.0 / _xp(x).sqrt(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (-0.5 * y * y * y)


class Sigmoid(Function):
    @staticmethod
    def forward(ctx, x):
        xp = _xp(x)
        y = 1.0 / (1.0 + xp.exp(-x))
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y * (1.0 - y)


class Tanh(Function):
    @staticmethod
    def forward(ctx, x):
        y = _xp(x).tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (1.0 - y * y)


class Sum(Function):
    @staticmethod
    def forward(ctx, x, axis=None, keepdims=False):
        ctx.shape, ctx.axis, ctx.keepdims = x.shape, axis, keepdims
        return x.sum(axis=axis, keepdims=keepdims)

    @staticmethod
    def backward(ctx, g):
        xp = _xp(g)
        if not ctx.keepdims and ctx.axis is not None:
            axes = (ctx.axis,) if isinstance(ctx.axis, int) else ctx.axis
            g = xp.expand_dims(g, tuple(a % len(ctx.shape) for a in axes))
        return xp.broadcast_to(g, ctx.shape)


class Cast(Function):
    @staticmethod
    def forward(ctx, x, dtype):
        ctx.src = x.dtype
        return x.astype(dtype)

    @staticmethod
    def backward(ctx, g):
        return g.astype(ctx.src), None


class MaskedFill(Function):
    """``where(mask, value, x)``; mask is a constant boolean array broadcastable to x."""

    @staticmethod
    def forward(ctx, x, mask, value):
        ctx.save_for_backward(mask)
        return _xp(x).where(mask, x.dtype.type(value), x)

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        return _xp(g).where(mask, g.dtype.type(0), g), None, None


# ============================================================================================ views
class Reshape(Function):
    @staticmethod
    def forward(ctx, x, shape):
        ctx.shape = x.shape
        return x.reshape(shape)

    @staticmethod
    def backward(ctx, g):
        return g.reshape(ctx.shape), None


class Transpose(Function):
    @staticmethod
    def forward(ctx, x, axes):
        ctx.axes = axes
        return x.transpose(axes)

    @staticmethod
    def backward(ctx, g):
        inv = None if ctx.axes is None else tuple(np.argsort(ctx.axes))
        return g.transpose(inv), None


class Contiguous(Function):
    @staticmethod
    def forward(ctx, x):
        return _xp(x).ascontiguousarray(x)

    @staticmethod
    def backward(ctx, g):
        return g


class GetItem(Function):
    @staticmethod
    def forward(ctx, x, idx):
        ctx.shape, ctx.dtype, ctx.idx = x.shape, x.dtype, idx
        return x[idx]

    @staticmethod
    def backward(ctx, g):
        gx = _xp(g).zeros(ctx.shape, dtype=g.dtype)
        gx[ctx.idx] = g
        return gx, None


class Concat(Function):
    @staticmethod
    def forward(ctx, axis, *xs):
        ctx.axis, ctx.sizes = axis, [x.shape[axis] for x in xs]
        return _xp(xs[0]).concatenate(xs, axis=axis)

    @staticmethod
    def backward(ctx, g):
        out, start = [None], 0
        for n in ctx.sizes:
            idx = [slice(None)] * g.ndim
            idx[ctx.axis] = slice(start, start + n)
            out.append(g[tuple(idx)])
            start += n
        return tuple(out)


class Take(Function):
    """``table[ids]`` (rows), the composite embedding; backward scatters with an unbuffered add."""

    @staticmethod
    def forward(ctx, table, ids):
        ctx.save_for_backward(ids)
        ctx.shape = table.shape
        return table[ids]

    @staticmethod
    def backward(ctx, g):
        (ids,) = ctx.saved_tensors
        xp = _xp(g)
        gt = xp.zeros(ctx.shape, dtype=g.dtype)
        g2 = g.reshape(-1, ctx.shape[-1])
        if xp is np:
            np.add.at(gt, ids.reshape(-1), g2)
        else:
            import cupyx
            cupyx.scatter_add(gt, ids.reshape(-1), g2)
        return gt, None


class PickLast(Function):
    """``x[..., t]`` for integer targets t of shape x.shape[:-1] (the composite cross-entropy's gather)."""

    @staticmethod
    def forward(ctx, x, t):
        xp = _xp(x)
        rows = xp.arange(t.size)
        ctx.save_for_backward(rows, t.reshape(-1))
        ctx.shape = x.shape
        return x.reshape(-1, x.shape[-1])[rows, t.reshape(-1)].reshape(t.shape)

    @staticmethod
    def backward(ctx, g):
        rows, t = ctx.saved_tensors
        gx = _xp(g).zeros((rows.size, ctx.shape[-1]), dtype=g.dtype)
        gx[rows, t] = g.reshape(-1)  # one target per row: a plain scatter
        return gx.reshape(ctx.shape), None


# ============================================================================================== GEMM
class Matmul(Function):
    """``a @ b`` (batched, same leading shape; no broadcasting, so every batched GEMM is a strided one)."""

    @staticmethod
    def forward(ctx, a, b, trans_b=False):
        ctx.save_for_backward(a, b)
        ctx.trans_b = trans_b
        return gemm(a, b, trans_b=trans_b)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        g = g if g.dtype == a.dtype else g.astype(a.dtype)
        ga = gb = None
        if ctx.trans_b:  # y = a b^T: da = g b, db = g^T a
            if ctx.needs_input_grad[0]:
                ga = gemm(g, b)
            if ctx.needs_input_grad[1]:
                gb = gemm(g, a, trans_a=True)
        else:  # y = a b: da = g b^T, db = a^T g
            if ctx.needs_input_grad[0]:
                ga = gemm(g, b, trans_b=True)
            if ctx.needs_input_grad[1]:
                gb = gemm(a, g, trans_a=True)
        return ga, gb, None


class Linear(Function):
    """``y = x @ W^T`` over the last axis of x; W is [out, in].

    ``w_lowp`` (optional) is the array the GEMMs read instead of W: the optimizer's bf16 shadow under autocast
    (no per-use cast), while the gradient still goes to W (fp32). Without it and with x in a lower precision
    than W, W is cast once per call. The weight gradient is accumulated straight into W's existing ``.grad``
    buffer through ``gemm(..., out=, accumulate=True)``.
    """

    @staticmethod
    def forward(ctx, x, w, w_lowp=None):
        wl = w_lowp if w_lowp is not None else (w if w.dtype == x.dtype else w.astype(x.dtype))
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, wl)
        ctx.xshape = x.shape
        return gemm(x2, wl, trans_b=True).reshape(x.shape[:-1] + (w.shape[0],))

    @staticmethod
    def backward(ctx, g):
        x2, wl = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        if g2.dtype != x2.dtype:
            g2 = g2.astype(x2.dtype)
        gx = gemm(g2, wl).reshape(ctx.xshape) if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1]:
            buf = ctx.leaf_grad(1)
            if buf is not None and buf.flags.c_contiguous:
                buf, acc = ctx.leaf_grad_write(1)  # beta = 0 on the first write of a lazily zeroed step
                gemm(g2, x2, trans_a=True, out=buf, accumulate=acc)
            else:
                gw = gemm(g2, x2, trans_a=True)
        return gx, gw, None


# ========================================================================== kernel-family Functions
class RMSNormF(Function):
    @staticmethod
    def forward(ctx, x, w, eps):
        y, rstd = _ck().rms_norm(x, w, eps, return_rstd=True)
        ctx.save_for_backward(x, w, rstd)
        return y

    @staticmethod
    def backward(ctx, g):
        x, w, rstd = ctx.saved_tensors
        dx, dw = _ck().rms_norm_backward(_contig(g, x.dtype), x, w, rstd)
        return dx, dw, None


class LayerNormF(Function):
    @staticmethod
    def forward(ctx, x, gamma, beta, eps):
        y, mean, rstd = _ck().layer_norm(x, gamma, beta, eps, return_stats=True)
        ctx.save_for_backward(x, gamma, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, g):
        x, gamma, mean, rstd = ctx.saved_tensors
        dx, dgamma, dbeta = _ck().layer_norm_backward(_contig(g, x.dtype), x, gamma, mean, rstd)
        return dx, dgamma, dbeta, None


class SoftmaxF(Function):
    @staticmethod
    def forward(ctx, x):
        y = _ck().softmax(x, axis=-1)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return _ck().softmax_backward(y, _contig(g, y.dtype))


class AttnSoftmaxF(Function):
    """``softmax(scale * scores + mask)`` over the last axis of [B, H, Tq, Tk] scores (ck.attn_softmax)."""

    @staticmethod
    def forward(ctx, scores, key_mask=None, causal=False, scale=1.0):
        p = _ck().attn_softmax(scores, key_mask=key_mask, causal=causal, scale=scale)
        ctx.save_for_backward(p)
        ctx.scale = scale
        return p

    @staticmethod
    def backward(ctx, g):
        (p,) = ctx.saved_tensors
        return _ck().attn_softmax_backward(p, _contig(g, p.dtype), scale=ctx.scale), None, None, None


class FlashAttentionF(Function):
    """Fused causal/non-causal attention on [B, T, heads, D] bf16 q, k, v (ck.flash_attention)."""

    @staticmethod
    def forward(ctx, q, k, v, causal=True, scale=None):
        o, lse = _ck().flash_attention(q, k, v, causal=causal, scale=scale, return_lse=True)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, g):
        q, k, v, o, lse = ctx.saved_tensors
        if g.dtype != o.dtype or not g.flags.c_contiguous:
            g = _contig(g, o.dtype)
        return (*_ck().flash_attention_backward(g, q, k, v, o, lse, causal=ctx.causal, scale=ctx.scale),
                None, None)


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
        ck = _ck()
        kw = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
        ctx.kw = kw
        if not ctx.needs_input_grad[0]:
            return ck.cross_entropy(logits, targets, **kw)
        if fused_backward:
            loss, dlogits = ck.cross_entropy_fused(logits, targets, **kw, out=logits if inplace else None)
            ctx.save_for_backward(dlogits)
            ctx.fused = True
            return loss
        loss, lse = ck.cross_entropy(logits, targets, **kw, return_lse=True)
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
        dl = _ck().cross_entropy_backward(logits, targets, lse, g, **ctx.kw)
        return (dl,) + (None,) * 6


class EmbeddingF(Function):
    """``table[ids]`` through ``ck.embedding``; dense gradient through ``ck.embedding_backward``, accumulated
    straight into the table's ``.grad`` buffer when it has one."""

    @staticmethod
    def forward(ctx, table, ids):
        ctx.save_for_backward(ids)
        ctx.V = table.shape[0]
        return _ck().embedding(ids, table)

    @staticmethod
    def backward(ctx, g):
        (ids,) = ctx.saved_tensors
        ck, g = _ck(), _contig(g)
        buf, acc = ctx.leaf_grad_write(0)
        if buf is not None:
            ck.embedding_backward(ids, g, ctx.V, out=buf, accumulate=acc)
            return None, None
        return ck.embedding_backward(ids, g, ctx.V), None


class SparseEmbeddingF(Function):
    """As EmbeddingF, but the gradient goes to ``table_tensor.sparse_grad`` (a ``ck.SparseRowGrad``: only the
    rows seen are touched, and the optimizer updates only those rows). ``table_lowp`` is an optional array
    read instead of the table (the bf16 shadow under autocast)."""

    @staticmethod
    def forward(ctx, table, ids, sparse_grad, table_lowp=None):
        ctx.save_for_backward(ids)
        ctx.sg = sparse_grad
        return _ck().embedding(ids, table if table_lowp is None else table_lowp)

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
        return _ck().embedding(ids, table_lowp)

    @staticmethod
    def backward(ctx, g):
        gt, _ = EmbeddingF.backward(ctx, g)
        return gt, None, None


class RopeF(Function):
    @staticmethod
    def forward(ctx, x, cos, sin, positions=None):
        ctx.save_for_backward(cos, sin, positions)
        return _ck().rope(x, cos, sin, positions=positions)

    @staticmethod
    def backward(ctx, g):
        cos, sin, positions = ctx.saved_tensors
        return _ck().rope_backward(_contig(g), cos, sin, positions=positions), None, None, None


class SwiGLUF(Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _ck().swiglu(gate, up)

    @staticmethod
    def backward(ctx, g):
        gate, up = ctx.saved_tensors
        return _ck().swiglu_backward(gate, up, _contig(g, gate.dtype))


class SwiGLUPackedF(Function):
    @staticmethod
    def forward(ctx, gu):
        ctx.save_for_backward(gu)
        return _ck().swiglu_packed(gu)

    @staticmethod
    def backward(ctx, g):
        (gu,) = ctx.saved_tensors
        return _ck().swiglu_packed_backward(gu, _contig(g, gu.dtype))


class GeluF(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return _ck().gelu(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return _ck().gelu_backward(x, _contig(g, x.dtype))


# ===================================================================================== functional API
def add(a, b): return Add.apply(a, b)
def sub(a, b): return Sub.apply(a, b)
def mul(a, b): return Mul.apply(a, b)
def div(a, b): return Div.apply(a, b)
def exp(x): return Exp.apply(x)
def log(x): return Log.apply(x)
def rsqrt(x): return Rsqrt.apply(x)
def sigmoid(x): return Sigmoid.apply(x)
def tanh(x): return Tanh.apply(x)
def pow(x, p): return PowScalar.apply(x, p)  # noqa: A001
def sum(x, axis=None, keepdims=False): return Sum.apply(x, axis, keepdims)  # noqa: A001
def reshape(x, shape): return Reshape.apply(x, tuple(shape))
def transpose(x, axes=None): return Transpose.apply(x, None if axes is None else tuple(axes))
def contiguous(x): return Contiguous.apply(x)
def getitem(x, idx): return GetItem.apply(x, idx)
def concat(xs, axis=-1): return Concat.apply(axis, *xs)
def masked_fill(x, mask, value): return MaskedFill.apply(x, mask, value)
def matmul(a, b, trans_b=False): return Matmul.apply(a, b, trans_b)


def mean(x, axis=None, keepdims=False):
    shape = _data(x).shape
    axes = range(len(shape)) if axis is None else ((axis,) if isinstance(axis, int) else axis)
    n = int(np.prod([shape[a] for a in axes]))
    return mul(sum(x, axis, keepdims), 1.0 / n)


def cast(x, dtype):
    dtype = np.dtype(dtype)
    return x if _data(x).dtype == dtype else Cast.apply(x, dtype)


def linear(x, w, w_lowp=None):
    """``x @ w.T`` (w is [out, in])."""
    return Linear.apply(x, w, w_lowp)


def silu(x):
    return mul(x, sigmoid(x))


def rms_norm(x, w, eps=1e-6, fused=True):
    """RMSNorm over the last axis. fused -> ck.rms_norm; else pow/mean/rsqrt/mul in fp32."""
    if fused:
        return RMSNormF.apply(x, w, eps)
    dt = _data(x).dtype
    xf = cast(x, np.float32) if dt == B.bfloat16 else x
    r = rsqrt(add(mean(pow(xf, 2), axis=-1, keepdims=True), eps))
    wf = cast(w, _data(xf).dtype)
    return cast(mul(mul(xf, r), wf), dt)


def layer_norm(x, gamma, beta, eps=1e-5, fused=True):
    if fused:
        return LayerNormF.apply(x, gamma, beta, eps)
    dt = _data(x).dtype
    xf = cast(x, np.float32) if dt == B.bfloat16 else x
    c = sub(xf, mean(xf, axis=-1, keepdims=True))
    r = rsqrt(add(mean(pow(c, 2), axis=-1, keepdims=True), eps))
    ft = _data(xf).dtype
    return cast(add(mul(mul(c, r), cast(gamma, ft)), cast(beta, ft)), dt)


def softmax(x, fused=True):
    """Softmax over the last axis. fused -> ck.softmax; else max/exp/sum (max held constant: exact)."""
    if fused:
        return SoftmaxF.apply(x)
    dt = _data(x).dtype
    xf = cast(x, np.float32) if dt == B.bfloat16 else x
    m = _data(xf).max(axis=-1, keepdims=True)
    e = exp(sub(xf, m))
    return cast(div(e, sum(e, axis=-1, keepdims=True)), dt)


def flash_attention(q, k, v, *, causal=True, scale=None):
    """Fused attention (ck.flash_attention): q [B, Tq, H, D], k/v [B, Tk, Hkv, D], bf16 -> o [B, Tq, H, D]."""
    return FlashAttentionF.apply(q, k, v, causal, scale)


def attn_softmax(scores, *, causal=False, scale=1.0, key_mask=None, fused=True):
    """softmax(scale * scores) over [B, H, Tq, Tk] with a causal mask aligned at the end (query i sees keys
    <= i + Tk - Tq) and an optional boolean key mask [B, Tk] (True = keep). Fully masked rows give zeros."""
    if fused:
        return AttnSoftmaxF.apply(scores, key_mask, causal, scale)
    s = _data(scores)
    xp, (Tq, Tk) = _xp(s), s.shape[-2:]
    dt = s.dtype
    x = mul(cast(scores, np.float32) if dt == B.bfloat16 else scores, scale)
    drop = None
    if causal:
        drop = xp.arange(Tk)[None, :] > (xp.arange(Tq)[:, None] + (Tk - Tq))
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


def cross_entropy(logits, targets, *, ignore_index=-100, reduction="mean", label_smoothing=0.0, fused=True,
                  inplace=False, fused_backward=True):
    """Token cross-entropy of [N, V] logits against int targets [N]; a 0-d fp32 loss. Targets equal to
    ignore_index count for nothing; "mean" divides by the number of the others."""
    if fused:
        return CrossEntropyF.apply(logits, targets, ignore_index, reduction, label_smoothing, inplace,
                                   fused_backward)
    t = _data(targets)
    xp = _xp(t)
    x = cast(logits, np.float32) if _data(logits).dtype == B.bfloat16 else logits
    m = _data(x).max(axis=-1, keepdims=True)
    z = sub(x, m)
    lse = log(sum(exp(z), axis=-1, keepdims=True))
    valid = t != ignore_index
    nll = sub(reshape(lse, t.shape), PickLast.apply(z, xp.where(valid, t, 0)))
    if label_smoothing:
        V = _data(x).shape[-1]
        smooth = sub(reshape(lse, t.shape), mul(sum(z, axis=-1), 1.0 / V))
        nll = add(mul(nll, 1.0 - label_smoothing), mul(smooth, label_smoothing))
    ft = _data(x).dtype
    tot = sum(mul(nll, valid.astype(ft)))
    if reduction == "sum":
        return tot
    return mul(tot, (1.0 / xp.maximum(valid.sum(), 1)).astype(ft))


def embedding(table, ids, *, fused=True, table_lowp=None, sparse=False):
    """Rows of ``table`` [V, D] at int ids; gradient dense (into table.grad) or sparse-row
    (into table.sparse_grad, a ck.SparseRowGrad)."""
    ids = _data(ids)
    if not fused:
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
    return _ck().SparseRowGrad(table.shape[0], table.shape[1])


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


def swiglu(gate, up, fused=True):
    """``silu(gate) * up``."""
    if fused:
        return SwiGLUF.apply(gate, up)
    return mul(silu(gate), up)


def swiglu_packed(gu, fused=True):
    """``silu(gu[..., :F]) * gu[..., F:]`` for gu [..., 2F]."""
    if fused:
        return SwiGLUPackedF.apply(gu)
    F2 = _data(gu).shape[-1]
    return swiglu(getitem(gu, (Ellipsis, slice(0, F2 // 2))), getitem(gu, (Ellipsis, slice(F2 // 2, None))),
                  fused=False)


def gelu(x, fused=True):
    """tanh-approximated GELU: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""
    if fused:
        return GeluF.apply(x)
    c = float(np.sqrt(2.0 / np.pi))
    inner = mul(add(x, mul(pow(x, 3), 0.044715)), c)
    return mul(mul(x, 0.5), add(tanh(inner), 1.0))


__all__ = [n for n in dir() if not n.startswith("_")]
_ = is_grad_enabled
