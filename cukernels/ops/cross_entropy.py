"""Softmax cross-entropy: ``ck.cross_entropy`` / ``ck.cross_entropy_backward`` / ``ck.cross_entropy_fused``.

Kernels: ``kernels_cu/cross_entropy.cu``. The loss stays on the device (a 0-d array): reading it back every
step is a host sync. Targets outside ``[0, V)`` that are not ``ignore_index`` raise on the NumPy path; on the GPU
the row is treated as ignored and 1 is ORed into a device error word (``ck.cross_entropy_error()``).

Row-strided logits and dlogits: the class axis must be contiguous, but rows may lie ``ld >= V`` elements apart
(the first V columns of a wider buffer, e.g. ``ck.blas.empty_padded((N, 50257), bf16)``: rows 50304 apart, so
the LM-head GEMMs stay on cuBLAS' 16-byte-aligned kernels). The row stride goes to the kernels by value; the
columns past V are never read or written.
"""
from __future__ import annotations

import numbers

import numpy as np

from .. import _backend as B
from .._loader import get_function
from ..settings import settings
from . import _launch as L

FAMILY = "cross_entropy"
INTS = (np.int32, np.int64)
REDUCTIONS = ("mean", "sum", "none")



def cross_entropy_error():
    """The module's device error word (0-d int32 CuPy array) for the current device.

    The GPU kernels OR 1 into it when a target outside ``[0, V)`` (and not ``ignore_index``) was met (that row
    then counts as ignored), unless an ``error=`` word was passed. Read it when a host sync is acceptable
    (``int(ck.cross_entropy_error())``) and clear it with ``.fill(0)``.
    """
    return B.error_word("cross_entropy")


def _row_stride(name, a):
    """Elements between consecutive rows of ``a`` [..., V]: the class (last) axis contiguous, the leading (row) axes
    walked by one stride ld >= V (C-contiguous: ld = V; a column slice ``buf[..., :V]``: ld = buf's row length).
    """
    V, s = a.shape[-1], a.itemsize
    if a.size == 0:
        return max(1, V)
    st = a.strides
    if V > 1 and st[-1] != s:
        raise ValueError(f"{name}: the class (last) axis must be contiguous (stride {s} bytes); got strides {st} for "
                         f"shape {tuple(a.shape)} (no silent copies are made: pass a C-contiguous array or a column "
                         "slice of one)")
    if B._kind(a) is not np and a.data.ptr % s:
        raise ValueError(f"{name}: the data pointer is not aligned to the {s}-byte element size")
    dims = [(n, t) for n, t in zip(a.shape[:-1], st[:-1]) if n > 1]
    if not dims:
        return V
    for (n0, t0), (n1, t1) in zip(dims, dims[1:]):
        if t0 != n1 * t1:
            raise ValueError(f"{name}: the rows are not evenly spaced (strides {st} for shape {tuple(a.shape)}); "
                             "expected the leading axes to be walked by one row stride")
    t = dims[-1][1]
    if t < 0 or t % s:
        raise ValueError(f"{name}: the row stride must be a non-negative multiple of the {s}-byte element size; got "
                         f"strides {st} for shape {tuple(a.shape)}")
    ld = t // s
    if ld < V:
        raise ValueError(f"{name}: rows overlap (row stride {ld} elements < {V} classes); got strides {st} for shape "
                         f"{tuple(a.shape)}")
    return ld


def _base_ptr(a):
    return a.__array_interface__["data"][0] if isinstance(a, np.ndarray) else a.data.ptr


def _check_dx_out(out, logits, ldx):
    """dlogits ``out``: dtype and shape of the logits, writable, row-strided like them; either the logits
    themselves (same address and row stride: in place) or memory disjoint from them. Returns its row stride."""
    B.check_dtype("out", out, (logits.dtype,))
    B.check_shape("out", out, logits.shape)
    B.check_writable("out", out)
    ldo = _row_stride("out", out)
    if logits.size == 0:
        return ldo
    s, V, N = logits.itemsize, logits.shape[-1], logits.size // logits.shape[-1]
    px, po = _base_ptr(logits), _base_ptr(out)
    if px == po and ldx == ldo:
        return ldo  # in place
    ex, eo = ((N - 1) * ldx + V) * s, ((N - 1) * ldo + V) * s
    if px < po + eo and po < px + ex:
        raise ValueError("out: overlaps logits without being them (pass out=logits for in place, or a separate "
                         "buffer)")
    return ldo


def _like_rows(xp, logits, ld):
    """A new array of the logits' shape and dtype whose rows lie ``ld`` elements apart, like theirs: padded logits
    give padded dlogits, so the gradient GEMMs that read them keep their aligned kernels and the two-pointer
    kernels their 16-byte path (the padding columns are left uninitialised and never read)."""
    V = logits.shape[-1]
    if ld == V or logits.size == 0:
        return xp.empty(logits.shape, dtype=logits.dtype)
    return xp.empty((*logits.shape[:-1], ld), dtype=logits.dtype)[..., :V]


def check_options(ignore_index, reduction, label_smoothing):
    """``(ignore_index, label_smoothing as the fp32 value the kernels use)`` after checking the loss options: one
    check for the kernels, ``linear_cross_entropy`` and the composite ``functional.cross_entropy(fused=False)``."""
    B.check_choice("reduction", reduction, REDUCTIONS)
    # int64 targets compare against ignore_index as int64 in the kernels.
    ig = B.check_int("ignore_index", ignore_index, min=-2**63, max=2**63 - 1)
    eps = float(np.float32(B.check_real("label_smoothing", label_smoothing, min=0, max=1)))
    return ig, eps


def _validate(logits, targets, ignore_index, reduction, label_smoothing, error):
    B.check_dtype("logits", logits, B.FLOATS)
    B.check_ndim("logits", logits, 1)
    V = logits.shape[-1]
    if V < 1:
        raise ValueError(f"logits: the class (last) axis must have at least 1 element; got shape {tuple(logits.shape)}")
    if V >= 2**31:
        raise ValueError(f"logits: at most 2**31 - 1 classes supported; got {V}")
    ld = _row_stride("logits", logits)
    B.check_dtype("targets", targets, INTS)
    B.check_shape("targets", targets, logits.shape[:-1], " (logits.shape[:-1])")
    B.check_contiguous("targets", targets)
    ig, eps = check_options(ignore_index, reduction, label_smoothing)
    if error is not None:
        B.check_dtype("error", error, (np.int32,))
        B.check_shape("error", error, ())
        B.check_writable("error", error)
    return V, ld, ig, eps


def _err(xp, error):
    if xp is np:
        return None
    return error if error is not None else cross_entropy_error()


def _host_check_targets(targets, V, ig):
    t = targets.reshape(-1)
    bad = (t != ig) & ((t < 0) | (t >= V))
    if bad.any():
        v = int(t[np.argmax(bad)])
        raise ValueError(f"targets: value {v} is out of range for {V} classes (valid: 0..{V - 1}, or ignore_index={ig})")


def _ref_rows(logits, targets, V, ig, eps):
    """NumPy path: (per-row loss f64, lse f64, valid mask, x as f64 2-D, flat targets)."""
    x = logits.reshape(-1, V).astype(np.float64)
    t = targets.reshape(-1).astype(np.int64)
    valid = t != ig
    m = x.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))[:, 0]
    ts = np.where(valid, t, 0)
    xt = x[np.arange(x.shape[0]), ts]
    loss = (1 - eps) * (lse - xt) + eps * (lse - x.mean(axis=1))
    loss = np.where(valid, loss, 0.0)
    return loss, lse, valid, x, ts


def _ref_reduce(loss, valid, reduction, shape):
    if reduction == "none":
        return loss.astype(np.float32).reshape(shape)
    s = loss.sum()
    if reduction == "mean":
        c = int(valid.sum())
        s = s / c if c else 0.0
    return np.asarray(s, dtype=np.float32)


def _ref_grad(x, lse, valid, ts, g_rows, eps, V):
    p = np.exp(x - lse[:, None])
    d = p - eps / V
    d[np.arange(x.shape[0]), ts] -= 1 - eps
    return np.where(valid[:, None], d * g_rows[:, None], 0.0)


def _dloss_rows(xp, dloss, reduction, valid, shape):
    """NumPy path: the per-row gradient scale g_i."""
    n = valid.shape[0]
    d = np.asarray(dloss, dtype=np.float64)
    if reduction == "none" and d.ndim:
        g = d.reshape(-1)
    else:
        g = np.full(n, float(d))
    if reduction == "mean":
        c = int(valid.sum())
        g = g / c if c else np.zeros(n)
    return g


def _check_dloss(xp, dloss, reduction, shape):
    """dloss: a Python float, a 0-d float32 array, or (reduction 'none') a float32 array of the row shape."""
    if B._kind(dloss) is None:
        if isinstance(dloss, (bool, np.bool_)) or not isinstance(dloss, numbers.Real):
            raise TypeError(f"dloss: expected a finite number or a float32 array; got {type(dloss).__name__}")
        return float(B.check_f32("dloss", dloss)), None
    B.array_module(dloss=dloss)
    if B._kind(dloss) is not xp:
        raise TypeError(f"dloss: is a {B._kind(dloss).__name__} array but logits is a {xp.__name__} array")
    B.check_dtype("dloss", dloss, (np.float32,))
    B.check_finite_host("dloss", dloss)  # (NumPy values only: device values are read by the kernels, no sync)
    if dloss.ndim == 0:
        return 0.0, dloss
    if reduction != "none":
        raise ValueError(f"dloss: expected a 0-d array for reduction={reduction!r}; got shape {tuple(dloss.shape)}")
    B.check_shape("dloss", dloss, shape, " (logits.shape[:-1], per-row for reduction='none')")
    B.check_contiguous("dloss", dloss)
    return 0.0, dloss


# The fused kernel's pass 2 reads its row for the last time and writes dx that this kernel never reads again: with
# ck.settings.ce_cache_hints both go to L2 as evict-first (ld / st .cs), so the rows still waiting for their pass 2 stay
# in L2 (132 rows of 256 KB in flight at V = 128256 bf16: 34 MB read + 34 MB written against 50 MB). Measured on the
# H200 in one process (`python benchmarks/bench_ops.py --only cross_entropy --ab "ce_cache_hints=0"`): 4096 x 128256
# bf16 0.727 ms against 0.810, 8192 x 50257 0.595 against 0.647; the same bits. False = plain loads / stores (the A/B
# row).


def _threads(V: int, itemsize: int) -> int:
    """Block size for one row: ~16 packs per thread, 128..1024 threads."""
    units = max(1, V // (16 // itemsize))
    t = 128
    while t < 1024 and units > t * 16:
        t *= 2
    return t


def _grid(k, N, threads):
    """Blocks for N rows: one wave of the kernel at most (a block loops over rows)."""
    return max(1, min(N, L.wave(k, threads)))


def _tag(logits, targets):
    return f"{B.DTYPE_TAG[logits.dtype]}_{B.DTYPE_TAG[targets.dtype]}"


def _count(xp, targets, N, V, ig):
    cnt = xp.empty((), dtype=np.int32)
    k = get_function(FAMILY, f"ce_count_{B.DTYPE_TAG[targets.dtype]}")
    k((1,), (1024, 1, 1), (targets, np.int64(N), np.int64(V), np.int64(ig), cnt))
    return cnt


def _reduce(xp, loss_row, N, cnt, out=None):
    loss = out if out is not None else xp.empty((), dtype=np.float32)
    get_function(FAMILY, "ce_reduce_loss")((1,), (1024, 1, 1), (loss_row, np.int64(N), cnt if cnt is not None else B.NULL, loss))
    return loss


@B.interop
def cross_entropy(logits, targets, *, ignore_index=-100, reduction="mean", label_smoothing=0.0, return_lse=False,
                  out=None, error=None):
    """Softmax cross-entropy of ``logits`` against integer ``targets``.

    Per row i with target t (eps = label_smoothing)::

        lse_i  = log(sum_j exp(x_ij))
        loss_i = (1 - eps) * (lse_i - x_it) + eps * (lse_i - mean_j x_ij)      (0 where t == ignore_index)

    ``mean`` divides the sum by the number of non-ignored rows (computed on the device; 0 when every row is
    ignored), ``sum`` sums, ``none`` returns loss_i. The reductions are deterministic (fixed-order, no atomics).

    Args:
        logits: ``(..., V)`` float32 or bfloat16 (leading dims are rows); the class axis contiguous, rows any
            stride >= V apart (the first V columns of a wider buffer are read as they are).
        targets: int32/int64, shape ``logits.shape[:-1]``.
        ignore_index: target value of rows that contribute nothing.
        reduction: "mean" | "sum" | "none".
        label_smoothing: eps in [0, 1].
        return_lse: also return lse (float32, ``logits.shape[:-1]``) for :func:`cross_entropy_backward`.
        out: optional float32 buffer for the loss: shape ``()`` for mean/sum, ``logits.shape[:-1]`` for none.
        error: optional 0-d int32 device error word (default :func:`cross_entropy_error`).

    Returns:
        ``loss`` (0-d float32 device array for mean/sum, float32 ``logits.shape[:-1]`` for none; ``out`` when
        given), or ``(loss, lse)``.

    Example::

        >>> loss, lse = ck.cross_entropy(logits, targets, return_lse=True)     # loss.shape == ()
        >>> dlogits = ck.cross_entropy_backward(logits, targets, lse, cp.ones((), cp.float32))
    """
    xp = B.array_module(logits=logits, targets=targets, out=out, error=error)
    V, ldx, ig, eps = _validate(logits, targets, ignore_index, reduction, label_smoothing, error)
    return_lse = B.check_bool("return_lse", return_lse)
    rshape = logits.shape[:-1]
    if out is not None:
        B.check_out("out", out, rshape if reduction == "none" else (), np.float32)
    N = targets.size
    if xp is np:
        _host_check_targets(targets, V, ig)
        loss, lse, valid, _, _ = _ref_rows(logits, targets, V, ig, eps)
        res = _ref_reduce(loss, valid, reduction, rshape)
        if out is not None:
            out[...] = res
            res = out
        return (res, lse.astype(np.float32).reshape(rshape)) if return_lse else res

    lse = xp.empty(rshape, dtype=np.float32) if return_lse else None
    loss_row = out if (out is not None and reduction == "none") else xp.empty(rshape, dtype=np.float32)
    if N:
        threads = _threads(V, logits.itemsize)
        k = get_function(FAMILY, f"ce_fwd_{_tag(logits, targets)}")
        k((_grid(k, N, threads),), (threads, 1, 1),
          (logits, targets, loss_row, lse if lse is not None else B.NULL, _err(xp, error), np.int64(N), np.int32(V),
           np.int64(ldx), np.int64(ig), np.float32(eps)))
    if reduction == "none":
        res = loss_row
    else:
        cnt = _count(xp, targets, N, V, ig) if reduction == "mean" else None
        res = _reduce(xp, loss_row, N, cnt, out)
    return (res, lse) if return_lse else res


def vec_pair(px, ldx, po, ldo, itemsize):
    """Whether two row-strided arrays share the kernels' per-row head / 16-byte body / tail split: every row pair
    congruent mod 16, i.e. the base pointers are, and so are the row strides' byte lengths."""
    return (px - po) % 16 == 0 and ((ldx - ldo) * itemsize) % 16 == 0


def _grad_launch(kind, xp, logits, targets, dx, lse, loss_row, V, ldx, ldo, ig, eps, reduction, dscalar, darr, error):
    N = targets.size
    cnt = _count(xp, targets, N, V, ig) if reduction == "mean" else None
    if N == 0:
        return cnt
    vec = vec_pair(logits.data.ptr, ldx, dx.data.ptr, ldo, logits.itemsize)
    threads = _threads(V, logits.itemsize)
    k = get_function(FAMILY, f"ce_{kind}_{_tag(logits, targets)}")
    grid = _grid(k, N, threads)
    cptr = cnt if cnt is not None else B.NULL
    dptr = darr if darr is not None else B.NULL
    if kind == "fused":
        k((grid,), (threads, 1, 1),
          (logits, targets, dx, loss_row, _err(xp, error), cptr, dptr, np.float32(dscalar), np.int64(N), np.int32(V),
           np.int64(ldx), np.int64(ldo), np.int64(ig), np.float32(eps), np.bool_(vec),
           np.bool_(settings.ce_cache_hints)))
    else:
        per_row = darr is not None and darr.ndim > 0
        k((grid,), (threads, 1, 1),
          (logits, targets, lse, dx, _err(xp, error), cptr, dptr, np.float32(dscalar), np.bool_(per_row), np.int64(N),
           np.int32(V), np.int64(ldx), np.int64(ldo), np.int64(ig), np.float32(eps), np.bool_(vec)))
    return cnt


@B.interop
def cross_entropy_backward(logits, targets, lse, dloss, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                           out=None, error=None):
    """Gradient of :func:`cross_entropy` with respect to the logits.

    ``dx_ij = g_i * (exp(x_ij - lse_i) - eps / V - (1 - eps) * [j == t_i])``, 0 on ignored rows, with
    ``g_i = dloss`` (sum), ``dloss / count`` (mean; count of non-ignored rows, computed on the device) or
    ``dloss_i`` (none). One read of the logits, one write of dx.

    Args:
        logits, targets: the forward inputs.
        lse: float32 ``logits.shape[:-1]`` from ``cross_entropy(..., return_lse=True)``.
        dloss: gradient of the loss: a float or a 0-d float32 array; for reduction "none" also a float32 array of
            shape ``logits.shape[:-1]``.
        ignore_index, reduction, label_smoothing: as in the forward.
        out: optional buffer for dx (dtype and shape of logits, row-strided like them; columns past V of a wider
            buffer are left alone); may be ``logits`` itself (in place), must not otherwise overlap them.
            Default: a new array with the logits' row stride (C-contiguous for C-contiguous logits).

    Returns:
        ``dlogits``, dtype and shape of ``logits``.
    """
    xp = B.array_module(logits=logits, targets=targets, lse=lse, out=out, error=error)
    V, ldx, ig, eps = _validate(logits, targets, ignore_index, reduction, label_smoothing, error)
    rshape = logits.shape[:-1]
    B.check_dtype("lse", lse, (np.float32,))
    B.check_shape("lse", lse, rshape, " (logits.shape[:-1])")
    B.check_contiguous("lse", lse)
    dscalar, darr = _check_dloss(xp, dloss, reduction, rshape)
    ldo = _check_dx_out(out, logits, ldx) if out is not None else max(1, ldx)  # (_like_rows: the logits' stride)
    dx = out if out is not None else _like_rows(xp, logits, ldx)
    if xp is np:
        _host_check_targets(targets, V, ig)
        _, _, valid, x, ts = _ref_rows(logits, targets, V, ig, eps)
        g = _dloss_rows(xp, darr if darr is not None else dscalar, reduction, valid, rshape)
        l64 = lse.reshape(-1).astype(np.float64)
        dx[...] = _ref_grad(x, l64, valid, ts, g, eps, V).reshape(logits.shape).astype(logits.dtype)
        return dx
    _grad_launch("bwd", xp, logits, targets, dx, lse, None, V, ldx, ldo, ig, eps, reduction, dscalar, darr, error)
    return dx


@B.interop
def cross_entropy_fused(logits, targets, *, ignore_index=-100, reduction="mean", label_smoothing=0.0, dloss=1.0,
                        out=None, error=None):
    """Cross-entropy forward and backward in one pass over the logits (llm.c's fused classifier).

    Returns the loss of :func:`cross_entropy` and the dlogits of :func:`cross_entropy_backward` for ``dloss``
    without materialising softmax or lse: each row is read once for (max, sum of exp), then re-read (mostly
    from L2) to write the gradient. With ``out=logits`` the gradient overwrites the logits in place, saving a
    vocabulary-sized buffer.

    Args:
        logits, targets, ignore_index, reduction, label_smoothing: as in :func:`cross_entropy`.
        dloss: float or 0-d float32 device array (read on the device; e.g. a loss scale).
        out: dlogits buffer (dtype and shape of logits, row-strided like them: only columns [0, V) of each row
            are written), or ``logits`` itself for in place; it must not otherwise overlap ``logits``. Default: a
            new array with the logits' row stride (C-contiguous for C-contiguous logits).

    Returns:
        ``(loss, dlogits)``: loss as in :func:`cross_entropy`, dlogits like ``logits``.

    Example::

        >>> loss, _ = ck.cross_entropy_fused(logits, targets, out=logits)    # logits now hold dlogits
        >>> z = ck.blas.empty_padded((N, 50257), ck.bfloat16)                 # GPT-2: rows 50304 apart
        >>> ck.matmul(h, wte, trans_b=True, out=z)
        >>> loss, dz = ck.cross_entropy_fused(z, targets, out=z)             # same row stride, in place
    """
    xp = B.array_module(logits=logits, targets=targets, out=out, error=error)
    V, ldx, ig, eps = _validate(logits, targets, ignore_index, reduction, label_smoothing, error)
    rshape = logits.shape[:-1]
    dscalar, darr = _check_dloss(xp, dloss, reduction, rshape)
    if darr is not None and darr.ndim:
        raise ValueError(f"dloss: expected a float or a 0-d float32 array; got shape {tuple(darr.shape)}")
    ldo = _check_dx_out(out, logits, ldx) if out is not None else max(1, ldx)  # (_like_rows: the logits' stride)
    dx = out if out is not None else _like_rows(xp, logits, ldx)
    N = targets.size
    if xp is np:
        _host_check_targets(targets, V, ig)
        loss, lse, valid, x, ts = _ref_rows(logits, targets, V, ig, eps)
        res = _ref_reduce(loss, valid, reduction, rshape)
        g = _dloss_rows(xp, darr if darr is not None else dscalar, reduction, valid, rshape)
        dx[...] = _ref_grad(x, lse, valid, ts, g, eps, V).reshape(logits.shape).astype(logits.dtype)
        return res, dx
    loss_row = xp.empty(rshape, dtype=np.float32)
    cnt = _grad_launch("fused", xp, logits, targets, dx, None, loss_row, V, ldx, ldo, ig, eps, reduction, dscalar, darr,
                       error)
    if reduction == "none":
        return loss_row, dx
    return _reduce(xp, loss_row, N, cnt), dx


__all__ = ["cross_entropy", "cross_entropy_backward", "cross_entropy_error", "cross_entropy_fused"]
