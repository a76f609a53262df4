"""Plain array Functions: arithmetic, reductions, views, gathers and the GEMMs.

The ``fused=False`` composite path of every layer is a tape of these, so its forward and backward are ordinary
CuPy/NumPy operations. Every GEMM goes through :func:`gemm` (one place to swap in another cuBLAS path).
"""
from __future__ import annotations

import numpy as np

from .. import _backend as B
from ..autograd import Function, Tensor, _xp, fast_add
from ..blas import layout_ok as _layout_ok
from ..blas import matmul as _ck_matmul
from ..ops.elementwise import add as _ck_add

_FLOAT_KINDS = "fc"


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


# ---- the composite (fused=False) paths check their arguments as the kernel ops do (issue 36); float64 stays
# allowed there (the gradient-check oracle), everything else matches: eps, weight shapes, ids and positions.
def _composite_norm_args(x, eps, **weights):
    xd = _data(x)
    if B._kind(xd) is None or not (xd.dtype.kind == "f" or xd.dtype == B.bfloat16) or xd.ndim < 1:
        raise TypeError(f"x: expected a float array or Tensor [..., C]; got {B._got(x)}")
    C = xd.shape[-1]
    for name, w in weights.items():
        wd = _data(w)
        if B._kind(wd) is None or tuple(wd.shape) != (C,):
            raise ValueError(f"{name}: expected shape ({C},) to match x's last axis; got "
                             f"{tuple(wd.shape) if B._kind(wd) is not None else B._got(w)}")
    B.check_real("eps", eps, min=0, min_open=True)


def _composite_rows(name, ids, n, xp, err_word):
    """Integer ``ids`` indexing ``n`` rows on a composite path: the NumPy path raises for one outside [0, n) (as
    the kernel ops' reference does; NumPy would wrap a negative one silently); on CuPy they are clamped into
    range and ``err_word`` is set, as the kernels do (device-side: no host read)."""
    if B._kind(ids) is None or ids.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer array; got {B._got(ids) if B._kind(ids) is None else ids.dtype}")
    if xp is np:
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= n):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise B.IdsOutOfRange(f"{name}: value {bad} is out of range for {n} rows (valid: 0..{n - 1})")
        return ids
    if err_word is not None:
        bad = ((ids < 0) | (ids >= n)).any().astype(np.int32)
        xp.bitwise_or(err_word, bad, out=err_word)
    return xp.clip(ids, 0, n - 1)


# ================================================================================================ GEMM
def gemm(a, b, *, trans_a=False, trans_b=False, out=None, accumulate=False):
    """``op(a) @ op(b)``, batched over equal leading axes (or one operand 2-D), ``op`` transposing the last two
    axes when asked; no transpose is materialised.

    The single place where the autograd issues matrix products, through ``ck.matmul`` (cuBLAS GemmEx on our
    own graph-capturable handle; bf16 inputs accumulate in fp32; NumPy reference on the CPU, float64 kept).
    With ``out`` the product is written into it, or -- ``accumulate=True``, the weight-gradient case -- added
    to it with beta = 1: bf16 operands accumulate straight into the fp32 ``.grad`` buffer.
    """
    xp = _xp(a)
    # Row-strided views (a padded logits buffer) go to cuBLAS as they are (lda = the row stride); others copy.
    a = a if _layout_ok(a) else xp.ascontiguousarray(a)
    b = b if _layout_ok(b) else xp.ascontiguousarray(b)
    if b.dtype != a.dtype:
        b = b.astype(a.dtype)
    if out is None:
        return _ck_matmul(a, b, trans_a=trans_a, trans_b=trans_b)
    direct = _layout_ok(out) and (out.dtype == a.dtype or (out.dtype == np.float32 and a.dtype == B.bfloat16))
    if direct:
        return _ck_matmul(a, b, trans_a=trans_a, trans_b=trans_b, out=out, beta=1.0 if accumulate else 0.0)
    r = _ck_matmul(a, b, trans_a=trans_a, trans_b=trans_b)
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


class Pow(Function):
    """``x ** p`` with both operands differentiable (a Tensor exponent: ``t ** u``, ``2 ** t``).

    ``dx = g p x^(p-1)``, ``dp = g x^p log(x)`` (0 where ``x^p`` is 0, as PyTorch; NaN for a negative base, as
    the real logarithm). A plain-number exponent takes :class:`PowScalar`."""

    @staticmethod
    def forward(ctx, x, p):
        y = x ** p
        ctx.save_for_backward(x, p, y)
        return y

    @staticmethod
    def backward(ctx, g):
        x, p, y = ctx.saved_tensors
        gx = gp = None
        if ctx.needs_input_grad[0]:
            gx = _unbroadcast(g * (p * x ** (p - 1)), _shape(x))
        if ctx.needs_input_grad[1]:
            xp = _xp(g)
            with np.errstate(divide="ignore", invalid="ignore"):
                lg = xp.where(y == 0, 0, y * xp.log(xp.asarray(x, dtype=g.dtype)))
            gp = _unbroadcast(g * lg, _shape(p))
        return gx, gp


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


class Erf(Function):
    """The error function (the exact GELU's), evaluated in float64 and rounded to x's dtype."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return _erf(x).astype(x.dtype)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        xp = _xp(x)
        return g * (2.0 / np.sqrt(np.pi) * xp.exp(-(x.astype(np.float64) ** 2))).astype(g.dtype)


def _erf(x):
    """erf in float64: CuPy's special function on the GPU; on NumPy (which has none) the Chebyshev fit of erfc
    from Numerical Recipes (erfcc: fractional error < 1.2e-7 everywhere, below fp32's resolution)."""
    xp = _xp(x)
    if xp is not np:
        import cupyx.scipy.special as sp
        return sp.erf(x.astype(np.float64))
    z = np.abs(x.astype(np.float64))
    t = 1.0 / (1.0 + 0.5 * z)
    poly = (-z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (
        0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277)))))))))
    erfc = t * np.exp(poly)
    return np.where(x >= 0, 1.0 - erfc, erfc - 1.0)


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
    """``y = x @ W^T (+ b)`` over the last axis of x; W is [out, in], b [out].

    ``w_lowp`` (optional) is the array the GEMMs read instead of W: the optimizer's bf16 shadow under autocast
    (no per-use cast), while the gradient still goes to W (fp32). Without it and with x in a lower precision
    than W, W is cast once per call. The weight gradient is accumulated straight into W's existing ``.grad``
    buffer through ``gemm(..., out=, accumulate=True)``.

    The bias is added in place to the GEMM's output (``ck.add`` broadcast over rows, in fp32 registers) and its
    gradient -- the column sums of dy -- is one more GEMM, ``ones[1, N] @ dy``: memory-bound, one read of dy,
    fp32 accumulation straight into b's ``.grad`` (GPT-2 124M at B8xT1024 spent 7 ms of a 43 ms step in CuPy's
    column sums and 3.3 ms in its broadcast adds before this).
    """

    @staticmethod
    def forward(ctx, x, w, w_lowp=None, b=None, pad_rows=False):
        wl = w_lowp if w_lowp is not None else (w if w.dtype == x.dtype else w.astype(x.dtype))
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, wl)
        ctx.xshape = x.shape
        ctx.full = None
        if pad_rows and b is None and _xp(x2) is not np and w.shape[0] % 64:
            # A vocabulary-sized output whose row length is not a multiple of 64 (GPT-2's 50257): cuBLAS falls back
            # to align1 kernels whenever the odd length is a GEMM dimension (15.6 ms of a 43 ms GPT-2 step). So
            # the GEMMs run on Vp = 50304: W copied into a zero-padded [Vp, in] buffer (77 MB, ~25 us) and the
            # logits written in full; the [N, V] view goes on (the loss reads the strided rows in place), its
            # padding columns are exactly 0 and stay 0, and the backward multiplies the full [N, Vp] buffer.
            V = w.shape[0]
            wp = _padded_weight(wl)
            full = gemm(x2, wp, trans_b=True, out=_xp(x2).empty((x2.shape[0], wp.shape[0]), dtype=x2.dtype))
            y = full[:, :V]
            ctx.full, ctx.wp = full, wp
        else:
            y = gemm(x2, wl, trans_b=True)
        if b is not None:
            if _xp(y) is np:
                y += b.astype(y.dtype)
            else:
                _ck_add(y, b, out=y)
        return y.reshape(x.shape[:-1] + (w.shape[0],))

    @staticmethod
    def backward(ctx, g):
        x2, wl = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        if g2.dtype != x2.dtype:
            g2 = g2.astype(x2.dtype)
        if ctx.needs_input_grad[0]:
            full = ctx.full
            if full is not None and g2.data.ptr == full.data.ptr and g2.strides == full.strides:
                gx = gemm(full, ctx.wp)  # dlogits written in place over the logits: padding columns still 0
            else:
                gx = gemm(g2, wl)
            gx = gx.reshape(ctx.xshape)
        else:
            gx = None
        gw = _weight_grad(ctx, 1, lambda out, acc: gemm(g2, x2, trans_a=True, out=out, accumulate=acc))
        gb = None
        if len(ctx.needs_input_grad) > 3 and ctx.needs_input_grad[3]:
            ones = _ones_row(_xp(g2), g2.shape[0], g2.dtype)
            gb = _weight_grad(ctx, 3, lambda out, acc: gemm(ones, g2, out=None if out is None else
                                                            out.reshape(1, -1), accumulate=acc))
            gb = None if gb is None else gb.reshape(-1)
        return gx, gw, None, gb, None


class PackedLinear(Function):
    """``y = x @ [W_1; ...; W_n]^T``: several projections of one input whose outputs are consumed side by side
    ([..., sum of out_i]: LLaMA's q / k / v and gate / up), each W_i [out_i, in] its own leaf.

    When the arrays the GEMMs read (the bf16 shadows under autocast) lie back to back in one allocation -- the
    optimizer's flat buffers put a module's parameters so -- the n projections are one GEMM each way: one
    forward product, one input gradient over K = sum of out_i (no per-projection dX and no adds of them), one
    weight gradient into the n ``.grad`` buffers when they are adjacent too. At B4xT64 on the LLaMA-1B shape the
    q / k / v GEMMs are 6-7 us each, latency-bound at M = 256, and the two input-gradient adds of a layer read
    and write [N, hidden] twice (`python benchmarks/bench_train.py --configs b4t64 --ab
    "pack_projections=0"`). Otherwise each W_i is its own GEMM on a column slice of y
    (ldc = the packed width) and the input gradients accumulate with beta = 1: never a copy of the weights.
    """

    @staticmethod
    def forward(ctx, x, lows, *ws):
        wls = [lo if lo is not None else (w if w.dtype == x.dtype else w.astype(x.dtype)) for w, lo in zip(ws, lows)]
        x2 = x.reshape(-1, x.shape[-1])
        cuts = np.cumsum([0] + [w.shape[0] for w in ws]).tolist()
        W = joined_rows(wls)
        if W is None and _xp(x2) is np:
            # The reference path multiplies the concatenated weights: the same products as the joined path, so a
            # model gives the same numbers whether its optimizer keeps the weights adjacent or not (ZeroAdamW pads
            # each bucket to world_size x 64 elements: on 2+ ranks a bucket boundary can fall inside q / k / v).
            W = np.concatenate(wls, axis=0)
        if W is not None:
            y = gemm(x2, W, trans_b=True)
        else:
            y = _xp(x2).empty((x2.shape[0], cuts[-1]), dtype=x2.dtype)
            for i, wl in enumerate(wls):
                gemm(x2, wl, trans_b=True, out=y[:, cuts[i]:cuts[i + 1]])
        ctx.save_for_backward(x2, W, wls)
        ctx.xshape, ctx.cuts = x.shape, cuts
        return y.reshape(x.shape[:-1] + (cuts[-1],))

    @staticmethod
    def backward(ctx, g):
        x2, W, wls = ctx.saved_tensors
        cuts, n = ctx.cuts, len(wls)
        g2 = g.reshape(-1, g.shape[-1])
        if g2.dtype != x2.dtype or not _layout_ok(g2):
            g2 = _contig(g2, x2.dtype)
        cols = [g2[:, cuts[i]:cuts[i + 1]] for i in range(n)]
        gx = None
        if ctx.needs_input_grad[0]:
            if W is not None:
                gx = gemm(g2, W)
            else:
                gx = gemm(cols[0], wls[0])
                for i in range(1, n):
                    gemm(cols[i], wls[i], out=gx, accumulate=True)
            gx = gx.reshape(ctx.xshape)
        gws = [None] * n
        want = [ctx.needs_input_grad[2 + i] for i in range(n)]
        bufs = [ctx.leaf_grad(2 + i) for i in range(n)]
        G = joined_rows(bufs) if all(want) else None
        stale = {ctx.inputs[2 + i].grad_stale for i in range(n)} if G is not None else set()
        if G is not None and len(stale) == 1:
            acc = False
            for i in range(n):
                _, acc = ctx.leaf_grad_write(2 + i)
            gemm(g2, x2, trans_a=True, out=G, accumulate=acc)
        elif _xp(g2) is np:  # one product split into the leaves: bit-identical to the joined path (see forward)
            full = gemm(g2, x2, trans_a=True)
            for i in range(n):
                part = full[cuts[i]:cuts[i + 1]]
                gws[i] = _weight_grad(ctx, 2 + i, lambda out, acc, p=part: p if out is None else _put(out, p, acc))
        else:
            for i in range(n):
                gws[i] = _weight_grad(ctx, 2 + i, lambda out, acc, c=cols[i]: gemm(c, x2, trans_a=True, out=out,
                                                                                   accumulate=acc))
        return (gx, None, *gws)


def _put(out, part, accumulate):
    if accumulate:
        out += part
    else:
        out[...] = part
    return out


def joined_rows(arrays):
    """One ``[sum of rows, cols]`` view over 2-D C-contiguous arrays of one dtype and width that lie back to back
    in one allocation (in order), else None. The view reads and writes exactly their elements."""
    if len(arrays) < 2 or any(a is None for a in arrays):
        return None
    a0 = arrays[0]
    xp = _xp(a0)
    ptr = (lambda a: a.data.ptr) if xp is not np else (lambda a: a.__array_interface__["data"][0])
    root = (lambda a: a.data.mem) if xp is not np else _np_root
    end, r0 = ptr(a0), root(a0)
    for a in arrays:
        if (type(a) is not type(a0) or a.ndim != 2 or a.dtype != a0.dtype or a.shape[1] != a0.shape[1]
                or not a.flags.c_contiguous or ptr(a) != end or root(a) is not r0):
            return None
        end += a.nbytes
    shape = (int(np.sum([a.shape[0] for a in arrays])), int(a0.shape[1]))  # (this module's sum is a Function)
    if xp is np:
        base = r0
        lo = ptr(a0) - base.__array_interface__["data"][0]
        if lo < 0 or lo + shape[0] * shape[1] * a0.itemsize > base.nbytes:
            return None
        return np.lib.stride_tricks.as_strided(a0, shape=shape, strides=(shape[1] * a0.itemsize, a0.itemsize))
    if ptr(a0) + shape[0] * shape[1] * a0.itemsize > r0.ptr + r0.size:
        return None
    return xp.ndarray(shape, dtype=a0.dtype, memptr=a0.data)


def _np_root(a):
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _weight_grad(ctx, i, product):
    """Input i's gradient from ``product(out, accumulate)``: written straight into its leaf ``.grad`` when it has
    a contiguous one (beta = 0 on the first write of a lazily zeroed step), else returned."""
    if not ctx.needs_input_grad[i]:
        return None
    buf = ctx.leaf_grad(i)
    if buf is not None and buf.flags.c_contiguous:
        buf, acc = ctx.leaf_grad_write(i)
        product(buf, acc)
        return None
    return product(None, False)


_PADDED: dict = {}


def _padded_weight(w):
    """``w`` [V, in] copied into a cached zero-padded [ceil(V/64)*64, in] buffer (padding rows stay 0)."""
    Vp = -(-w.shape[0] // 64) * 64
    key = (w.data.ptr, w.shape, w.dtype.str)
    buf = _PADDED.get(key)
    if buf is None:
        buf = _PADDED[key] = _xp(w).zeros((Vp, w.shape[1]), dtype=w.dtype)
    buf[:w.shape[0]] = w
    return buf


_ONES: dict = {}


def _ones_row(xp, n, dtype):
    """A cached [1, n] row of ones (the bias-gradient GEMM's left operand): made once per size, outside any
    captured step's pool after the warm-up."""
    key = (xp.__name__, n, np.dtype(dtype))
    if key not in _ONES:
        _ONES[key] = xp.ones((1, n), dtype=dtype)
    return _ONES[key]


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
def erf(x): return Erf.apply(x)
def pow(x, p):  # noqa: A001
    """``x ** p``: a Tensor exponent is differentiated too (:class:`Pow`), a number is a constant (PowScalar)."""
    return Pow.apply(x, p) if isinstance(p, Tensor) else PowScalar.apply(x, p)
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


def linear(x, w, w_lowp=None, b=None, *, pad_rows=False):
    """``x @ w.T (+ b)`` (w is [out, in]); ``pad_rows``: the output rows 64 elements apart (a strided view; on
    CuPy, without bias) for a vocabulary-sized projection."""
    return Linear.apply(x, w, w_lowp, b, pad_rows)


def packed_linear(x, ws, lows=None):
    """``x @ concat(ws, axis=0).T`` as :class:`PackedLinear` (each w [out_i, in] a leaf; ``lows``: the arrays the
    GEMMs read instead, e.g. bf16 shadows, one per w or None)."""
    ws = list(ws)
    return PackedLinear.apply(x, tuple(lows) if lows is not None else (None,) * len(ws), *ws)


def silu(x):
    return mul(x, sigmoid(x))


__all__ = ["Add", "Sub", "Mul", "Div", "PowScalar", "Pow", "Exp", "Log", "Rsqrt", "Sigmoid", "Tanh", "Erf", "Sum",
           "Cast", "MaskedFill", "Reshape", "Transpose", "Contiguous", "GetItem", "Concat", "Take", "PickLast",
           "Matmul", "Linear", "PackedLinear", "gemm", "joined_rows", "add", "sub", "mul", "div", "exp", "log",
           "rsqrt", "sigmoid", "tanh", "erf", "pow", "sum", "reshape", "transpose", "contiguous", "getitem", "concat",
           "masked_fill", "matmul", "mean", "cast", "linear", "packed_linear", "silu"]


