"""FP8 casts with the scales on the device: ``ck.fp8_amax``, ``ck.fp8_scale``, ``ck.fp8_cast``, ``ck.fp8_quantize``,
``ck.fp8_history``, ``ck.fp8_dequantize``, ``ck.fp8_transpose``. Kernels: ``kernels_cu/fp8.cu``; the FP8 GEMM is
``ck.matmul`` on these (``cukernels/blaslt.py``).

FP8 data is held as **uint8 arrays of the FP8 bits**: CuPy 14 has no float8 dtype (it knows a C type for
ml_dtypes' bfloat16 only), so on the device a uint8 array carries them and the ops that read FP8 are told the format
(``ck.float8_e4m3fn``: 1-4-3, max 448, for activations and weights; ``ck.float8_e5m2``: 1-5-2, max 57344, for
gradients). On the NumPy path the same uint8 bits are returned, and ``q.view(ck.float8_e4m3fn)`` is the ml_dtypes
array; the ops also take ml_dtypes float8 arrays, whose dtype then names the format.

Scaling is per tensor: ``q = fp8(x * s)``, and a GEMM multiplies the FP8 product by ``s_inv = 1 / s``
(``ck.matmul(..., a_scale=s_inv_a, b_scale=s_inv_b)``). ``s = fp8_max * 2**-margin / amax`` puts the largest
magnitude at the format's largest value. *Current* scaling takes the amax of the tensor being cast (an amax pass,
then the cast pass: :func:`fp8_quantize`); *delayed* scaling takes the amax the previous cast of the same tensor
left in a device history and records this one's in the same pass (:func:`fp8_quantize` with ``history=``, one
pass). Casts saturate (values beyond the format's max become +-max, inf too; NaN stays NaN) and round to nearest
even: bit for bit ``ml_dtypes`` on ``numpy.clip(x * s, -max, max)``. Everything is graph-capturable: scales and
amaxes are 0-d device arrays, nothing is read back to the host.
"""
from __future__ import annotations

import numpy as np

from .. import _backend as B
from .._loader import get_function
from . import _launch as L

FAMILY = "fp8"
THREADS = 256
UINT8 = np.dtype(np.uint8)
_UINT32 = np.dtype(np.uint32)
FP8_MAX = {B.float8_e4m3fn: 448.0, B.float8_e5m2: 57344.0}
_FLT_MIN = np.float32(np.finfo(np.float32).tiny)
_SCALE_MAX = np.float32(2.0 ** 126)  # the largest scale: 1 / scale stays normal (kernels flush subnormals)


# ---------------------------------------------------------------------------------------------- formats
def fp8_format(name, dtype) -> np.dtype:
    """An FP8 format argument (``ck.float8_e4m3fn``, ``ck.float8_e5m2``, or their names) as ``np.dtype``."""
    return B.check_dtype_arg(name, dtype, B.FP8)


def fp8_operand(name, q, fmt=None, fmt_name=None):
    """``(uint8 bits, format)`` of an FP8 operand: a uint8 array with its format given (``fmt``, the argument
    ``fmt_name``), or a NumPy ml_dtypes float8 array (its dtype is the format; a given ``fmt`` must agree)."""
    fmt_name = fmt_name or f"{name}_dtype"
    B.check_array(name, q)
    if q.dtype in B.FP8:
        if fmt is not None and fp8_format(fmt_name, fmt) != q.dtype:
            raise TypeError(f"{fmt_name}: {np.dtype(fmt)} disagrees with {name}'s dtype {q.dtype}")
        return q.view(UINT8), q.dtype
    if q.dtype != UINT8:
        raise TypeError(f"{name}: expected FP8 data (uint8 bits with {fmt_name}=ck.float8_e4m3fn / ck.float8_e5m2, "
                        f"or a NumPy float8 array); got dtype {q.dtype}")
    if fmt is None:
        raise TypeError(f"{fmt_name}: required for FP8 data held as uint8 bits ({name}); pass ck.float8_e4m3fn or "
                        "ck.float8_e5m2")
    return q, fp8_format(fmt_name, fmt)


def _fmax_m(fmt, margin) -> np.float32:
    return np.float32(FP8_MAX[fmt] * 2.0 ** -margin)


def _check_margin(margin) -> int:
    return B.check_int("margin", margin, min=0, max=64)


def _scalar_f32(name, a, writable=False):
    B.check_dtype(name, a, (np.float32,))
    if a.ndim != 0:
        raise ValueError(f"{name}: expected a 0-d float32 array (a device scalar); got shape {tuple(a.shape)}")
    if writable:
        B.check_writable(name, a)
    return a


def _check_x(x, transpose):
    B.check_dtype("x", x, B.FLOATS)
    B.check_contiguous("x", x)
    if transpose and x.ndim != 2:
        raise ValueError(f"x: transpose=True needs a 2-D (rows, cols) array; got shape {tuple(x.shape)} (reshape "
                         "it to 2-D first)")


def _outs(xp, x, transpose, out, out_t):
    q = B.empty(xp, x.shape, UINT8, out)
    qt = None
    if transpose:
        qt = B.empty(xp, x.shape[::-1], UINT8, out_t, name="out_t")
    elif out_t is not None:
        raise ValueError("out_t: given but transpose=False (the transposed copy is written only with transpose=True)")
    return q, qt


# ---------------------------------------------------------------------------------------------- reference
def ref_scale(amax, fmt, margin=0) -> np.float32:
    """The scale the kernels compute from ``amax`` (float32 math): ``fp8_max * 2**-margin / amax``, at most 2^126;
    1 when amax is 0, below 2^-126, inf or NaN (no usable information)."""
    a = np.float32(amax)
    if not (a >= _FLT_MIN) or np.isinf(a):
        return np.float32(1.0)
    with np.errstate(over="ignore"):
        s = _fmax_m(fmt, margin) / a
    return np.minimum(s, _SCALE_MAX)


def ref_cast(x, s, fmt):
    """The kernels' cast on the host: uint8 FP8 bits of ``sat(x * s)`` (fp32 inputs below 2^-126 flushed to zero,
    as the kernels compiled with -ftz do)."""
    xf = x.astype(np.float32)
    tiny = np.abs(xf) < _FLT_MIN
    if tiny.any():
        xf = np.where(tiny, np.copysign(np.float32(0), xf), xf)
    mx = np.float32(FP8_MAX[fmt])
    with np.errstate(invalid="ignore", over="ignore"):
        v = xf * np.float32(s)
        return np.clip(v, -mx, mx).astype(fmt).view(UINT8)


def ref_amax(x) -> np.float32:
    if x.size == 0:
        return np.float32(0.0)
    return np.float32(np.max(np.abs(x.astype(np.float32))))


def _as_bits(v) -> np.uint32:
    return np.array(v, np.float32).reshape(()).view(np.uint32)


# ---------------------------------------------------------------------------------------------- launches
def _grid(k, units):
    return int(max(1, min(-(-units // THREADS), L.wave(k, THREADS))))


def _tile_grid(k, rows, cols):
    """Blocks for the 64 x 64-tile kernels (cast_t, the fused SwiGLU cast, transpose): a tile each, at most a wave."""
    return int(max(1, min(-(-rows // 64) * -(-cols // 64), L.wave(k, THREADS))))


def _vec_flat(x, q):
    return x.size >= 16 and B.aligned16(x, q)


def _launch_cast(x, q, qt, fmt, scale_args):
    """cast (flat) or cast_t (2-D with the transposed copy) on the device; ``scale_args``: the FP8_SCALE_ARGS."""
    tag = f"{B.DTYPE_TAG[x.dtype]}_{B.DTYPE_TAG[fmt]}"
    if qt is None:
        vec = _vec_flat(x, q)
        k = get_function(FAMILY, f"fp8_cast_{tag}_{'v' if vec else 's'}")
        units = x.size // 16 + x.size % 16 if vec else x.size
        k((_grid(k, units),), (THREADS,), (x, q, np.int64(x.size), *scale_args))
        return
    rows, cols = x.shape
    if rows >= 2**31 or cols >= 2**31:
        raise ValueError(f"x: transpose=True takes at most 2**31 - 1 rows and columns; got shape {tuple(x.shape)}")
    vec = rows % 16 == 0 and cols % 16 == 0 and B.aligned16(x, q, qt)
    k = get_function(FAMILY, f"fp8_cast_t_{tag}_{'v' if vec else 's'}")
    k((_tile_grid(k, rows, cols),), (THREADS,), (x, q, qt, np.int32(rows), np.int32(cols), *scale_args))


def _scale_args(*, amax_src=None, scale=None, fmax_m=np.float32(0), scale_inv=None, amax_out=None, hist=None):
    dev_scale = scale is not None and B._kind(scale) is not None
    return (amax_src if amax_src is not None else B.NULL,
            scale if dev_scale else B.NULL,
            np.float32(1.0 if scale is None or dev_scale else scale),
            np.float32(fmax_m),
            scale_inv if scale_inv is not None else B.NULL,
            amax_out if amax_out is not None else B.NULL,
            hist if hist is not None else B.NULL)


def _amax_into(x, out):
    """out (0-d float32) = max(out, max |x|) on the device."""
    if x.size == 0:
        return
    vec = _vec_flat(x, x)
    k = get_function(FAMILY, f"fp8_amax_{B.DTYPE_TAG[x.dtype]}_{'v' if vec else 's'}")
    units = x.size // 16 + x.size % 16 if vec else x.size
    k((_grid(k, units),), (THREADS,), (x, np.int64(x.size), out))


# ---------------------------------------------------------------------------------------------- public ops
@B.interop
def fp8_amax(x, *, out=None):
    """``max |x|`` as a 0-d float32 array, on the device (no host sync).

    One pass; per thread, warp and block an unsigned max of the bits of ``|x|`` (which order like the values), then
    one atomicMax a block: deterministic. NaN anywhere gives NaN; an empty ``x`` gives 0.

    Args:
        x: float32 or bfloat16, C-contiguous, any shape.
        out: optional 0-d float32 output (overwritten).

    Returns:
        the 0-d float32 array.

    Example::

        >>> a = ck.fp8_amax(x)          # a device scalar
    """
    xp = B.array_module(x=x, out=out)
    _check_x(x, False)
    res = out if out is not None else xp.empty((), np.float32)
    _scalar_f32("out", res, writable=True)
    if xp is np:
        res[...] = ref_amax(x)
        return res
    B.zero_(res)
    _amax_into(x, res)
    return res


@B.interop
def fp8_scale(amax, *, dtype=B.float8_e4m3fn, margin=0, out=None, out_inv=None):
    """The per-tensor scale for an FP8 cast, and its inverse, from an amax on the device (one tiny kernel).

    ``scale = fp8_max * 2**-margin / amax`` (float32, IEEE division), at most 2^126 (so that ``scale_inv`` is a
    normal float32); ``scale = 1`` when amax is 0, below 2^-126, inf or NaN. ``scale_inv = 1 / scale`` is what a
    GEMM multiplies the FP8 product by.

    Args:
        amax: 0-d float32 array (:func:`fp8_amax`), >= 0.
        dtype: the FP8 format (``ck.float8_e4m3fn``: max 448; ``ck.float8_e5m2``: max 57344).
        margin: an integer in [0, 64]: the scale is divided by ``2**margin`` (headroom for a growing amax).
        out, out_inv: optional 0-d float32 outputs.

    Returns:
        ``(scale, scale_inv)``, 0-d float32 arrays.

    Example::

        >>> s, s_inv = ck.fp8_scale(ck.fp8_amax(w), dtype=ck.float8_e4m3fn)
        >>> w8 = ck.fp8_cast(w, s)
    """
    xp = B.array_module(amax=amax, out=out, out_inv=out_inv)
    _scalar_f32("amax", amax)
    fmt = fp8_format("dtype", dtype)
    margin = _check_margin(margin)
    s = out if out is not None else xp.empty((), np.float32)
    si = out_inv if out_inv is not None else xp.empty((), np.float32)
    _scalar_f32("out", s, writable=True)
    _scalar_f32("out_inv", si, writable=True)
    if xp is np:
        v = ref_scale(amax, fmt, margin)
        s[...] = v
        si[...] = np.float32(1.0) / v
        return s, si
    get_function(FAMILY, "fp8_scale")((1,), (32,), (amax, _fmax_m(fmt, margin), s, si))
    return s, si


@B.interop
def fp8_cast(x, scale, *, dtype=B.float8_e4m3fn, transpose=False, out=None, out_t=None, amax=None):
    """``q = fp8(x * scale)``: a saturating FP8 cast with a given scale, optionally with the transposed copy and
    the amax of ``x`` from the same pass.

    Rounds to nearest even; values beyond the format's max (inf too) become +-max; NaN stays NaN (``sign | 0x7f``
    for E4M3, ``sign | 0x7e`` for E5M2): bit for bit ``ml_dtypes`` on ``numpy.clip(x * scale, -max, max)``. fp32
    products below 2^-126 count as zero (the kernels flush subnormals). 16-byte accesses when the pointers are
    aligned; any size and shape.

    Args:
        x: float32 or bfloat16, C-contiguous (2-D with ``transpose``).
        scale: the multiplier, a number or a 0-d float32 array (read on the device: a captured graph sees its
            current value).
        dtype: the FP8 format, ``ck.float8_e4m3fn`` (default) or ``ck.float8_e5m2``.
        transpose: also write ``q_t = q.T`` ([cols, rows], C-contiguous) from the same tiles: the K-major operand
            cuBLASLt's FP8 GEMM wants for a product over x's rows (a weight gradient) or of ``W^T``.
        out, out_t: optional uint8 outputs (``x.shape``; ``x.shape[::-1]``).
        amax: optional 0-d float32 array (>= 0): ``amax = max(amax, max |x|)`` in the same pass (delayed scaling
            records the amax for the next cast this way).

    Returns:
        ``q`` (uint8 FP8 bits of ``x.shape``), or ``(q, q_t)`` with ``transpose``.

    Example::

        >>> q = ck.fp8_cast(x, 16.0)                                       # e4m3 bits, uint8
        >>> q, qt = ck.fp8_cast(x, s_dev, transpose=True, amax=amax_dev)   # device scale, amax recorded
        >>> numpy.asarray(q.get()).view(ck.float8_e4m3fn)                  # the values as ml_dtypes sees them
    """
    xp = B.array_module(x=x, scale=scale if B._kind(scale) is not None else None, out=out, out_t=out_t, amax=amax)
    transpose = B.check_bool("transpose", transpose)
    _check_x(x, transpose)
    fmt = fp8_format("dtype", dtype)
    if B._kind(scale) is not None:
        _scalar_f32("scale", scale)
    else:
        B.check_f32("scale", scale, min=0, min_open=True)
    if amax is not None:
        _scalar_f32("amax", amax, writable=True)
    q, qt = _outs(xp, x, transpose, out, out_t)
    if xp is np:
        q[...] = ref_cast(x, np.float32(scale), fmt)
        if qt is not None:
            qt[...] = q.T
        if amax is not None and x.size:
            amax[...] = np.maximum(np.float32(amax), ref_amax(x))
        return (q, qt) if transpose else q
    if x.size:
        _launch_cast(x, q, qt, fmt, _scale_args(scale=scale, amax_out=amax))
    return (q, qt) if transpose else q


@B.interop
def fp8_history(x):
    """A delayed-scaling history for :func:`fp8_quantize`, seeded with ``max |x|`` (so the first cast is scaled
    like the rest, not by 1): a uint32[4] array on x's module (the amax in use, as float32 bits; the running
    amax; a block counter; padding). One per tensor that is cast again and again (a layer's input, its output
    gradient)."""
    xp = B.array_module(x=x)
    _check_x(x, False)
    h = xp.zeros((4,), _UINT32)
    if xp is np:
        h[0] = _as_bits(ref_amax(x))
    elif x.size:
        _amax_into(x, h[:1].view(np.float32).reshape(()))
    return h


def _check_history(h):
    B.check_dtype("history", h, (_UINT32,))
    if h.shape != (4,):
        raise ValueError(f"history: expected a uint32 array of shape (4,) (from ck.fp8_history); got shape "
                         f"{tuple(h.shape)}")
    B.check_contiguous("history", h)
    B.check_writable("history", h)


@B.interop
def fp8_quantize(x, *, dtype=B.float8_e4m3fn, margin=0, transpose=False, history=None, amax=None, out=None,
                 out_t=None, scale_inv=None):
    """Per-tensor FP8 quantisation with the scale computed on the device: ``q = fp8(x * s)`` and ``s_inv = 1 / s``.

    Current scaling (``history=None``): ``s`` from ``max |x|``: an amax pass, then the cast pass, which computes
    ``s = fp8_max * 2**-margin / amax`` in every block from the amax in device memory (two launches, 2 + 3 bytes an
    element for bf16 x). Delayed scaling (``history`` from :func:`fp8_history`): ``s`` from the amax the previous
    quantisation of this tensor recorded; this one's amax goes into the history in the same pass, rolled by the
    last block (one launch, 3 bytes an element). The scale rule and the cast are :func:`fp8_scale` and
    :func:`fp8_cast`'s.

    Args:
        x: float32 or bfloat16, C-contiguous (2-D with ``transpose``).
        dtype: the FP8 format (``ck.float8_e4m3fn`` default, ``ck.float8_e5m2`` for gradients).
        margin: an integer in [0, 64]; the scale is divided by ``2**margin``.
        transpose: also write ``q_t = q.T`` (see :func:`fp8_cast`).
        history: optional delayed-scaling state (uint32[4], :func:`fp8_history`), updated in place.
        amax: optional 0-d float32 array already holding ``max |x|`` (from the kernel that wrote x, e.g.
            ``ck.swiglu_packed(..., amax=)``): current scaling from it, without the amax pass (one launch, 3 bytes
            an element). Not with ``history``.
        out, out_t: optional uint8 outputs; scale_inv: optional 0-d float32 output.

    Returns:
        ``(q, scale_inv)``, or ``(q, q_t, scale_inv)`` with ``transpose``: uint8 FP8 bits and a 0-d float32 array.

    Example::

        >>> xq, xqt, sx = ck.fp8_quantize(x, transpose=True)                      # e4m3, current scaling
        >>> wq, sw = ck.fp8_quantize(w)
        >>> y = ck.matmul(xq, wq, trans_b=True, a_scale=sx, b_scale=sw, a_dtype=ck.float8_e4m3fn,
        ...               b_dtype=ck.float8_e4m3fn, out_dtype=ck.bfloat16)       # x @ w.T in FP8
    """
    xp = B.array_module(x=x, history=history, amax=amax, out=out, out_t=out_t, scale_inv=scale_inv)
    transpose = B.check_bool("transpose", transpose)
    _check_x(x, transpose)
    fmt = fp8_format("dtype", dtype)
    margin = _check_margin(margin)
    if history is not None:
        _check_history(history)
        if amax is not None:
            raise ValueError("amax: a given max |x| is current scaling; history is delayed scaling: pass one of them")
    if amax is not None:
        _scalar_f32("amax", amax)
    si = scale_inv if scale_inv is not None else xp.empty((), np.float32)
    _scalar_f32("scale_inv", si, writable=True)
    q, qt = _outs(xp, x, transpose, out, out_t)
    res = (q, qt, si) if transpose else (q, si)
    if xp is np:
        if history is not None:
            a = history[:1].view(np.float32)[0]
        else:
            a = np.float32(amax) if amax is not None else ref_amax(x)
        s = ref_scale(a, fmt, margin)
        si[...] = np.float32(1.0) / s
        q[...] = ref_cast(x, s, fmt)
        if qt is not None:
            qt[...] = q.T
        if history is not None:
            history[0] = _as_bits(ref_amax(x))
            history[1:3] = 0
        return res
    fm = _fmax_m(fmt, margin)
    if history is not None:
        if x.size == 0:  # no block would run the roll: the scale from the history, then the history of nothing
            get_function(FAMILY, "fp8_scale")((1,), (32,), (history, fm, B.NULL, si))
            B.zero_(history[:3])
            return res
        args = _scale_args(amax_src=history, fmax_m=fm, scale_inv=si, amax_out=L.ptr(history, 1), hist=history)
    else:
        if amax is None:
            amax = xp.empty((), np.float32)
            B.zero_(amax)
            _amax_into(x, amax)
        if x.size == 0:
            get_function(FAMILY, "fp8_scale")((1,), (32,), (amax, fm, B.NULL, si))
            return res
        args = _scale_args(amax_src=amax, fmax_m=fm, scale_inv=si)
    _launch_cast(x, q, qt, fmt, args)
    return res


@B.interop
def fp8_swiglu_quantize(gu, history, *, dtype=B.float8_e4m3fn, margin=0, out=None, out_t=None, scale_inv=None):
    """``h = swiglu_packed(gu)`` quantised to FP8 with its transposed copy in one pass, h never stored in bf16:
    ``(q, q_t, s_inv)`` equal bit for bit to ``fp8_quantize(ck.swiglu_packed(gu), transpose=True,
    history=history)``. Delayed scaling only (current scaling needs max |h| before the pass:
    ``ck.swiglu_packed(gu, amax=a)`` then ``fp8_quantize(h, amax=a)``). The FP8 MLP's forward
    (``autocast(ck.float8)``, delayed or hybrid scaling): 4 bytes an element of h + 2 for q and q_t instead of
    the unfused pair's 10.

    Args:
        gu: ``(rows, 2F)`` bfloat16, C-contiguous: ``[gate | up]`` as :func:`swiglu_packed` takes it.
        history: the delayed-scaling state of h (uint32[4], :func:`fp8_history`), updated in place.
        dtype: the FP8 format (``ck.float8_e4m3fn`` default).
        margin: an integer in [0, 64]; the scale is divided by ``2**margin``.
        out, out_t: optional uint8 outputs ``(rows, F)`` and ``(F, rows)``; scale_inv: optional 0-d float32.

    Returns:
        ``(q, q_t, scale_inv)``.
    """
    xp = B.array_module(gu=gu, history=history, out=out, out_t=out_t, scale_inv=scale_inv)
    B.check_dtype("gu", gu, (B.bfloat16,))
    B.check_contiguous("gu", gu)
    if gu.ndim != 2 or gu.shape[1] % 2 or gu.shape[1] == 0:
        raise ValueError(f"gu: expected a 2-D (rows, 2F) [gate | up] array with an even, nonzero last axis; got "
                         f"shape {tuple(gu.shape)}")
    _check_history(history)
    fmt = fp8_format("dtype", dtype)
    margin = _check_margin(margin)
    rows, F = gu.shape[0], gu.shape[1] // 2
    if rows >= 2**31 or F >= 2**31:
        raise ValueError(f"gu: at most 2**31 - 1 rows and gate columns; got shape {tuple(gu.shape)}")
    si = scale_inv if scale_inv is not None else xp.empty((), np.float32)
    _scalar_f32("scale_inv", si, writable=True)
    q = B.empty(xp, (rows, F), UINT8, out)
    qt = B.empty(xp, (F, rows), UINT8, out_t, name="out_t")
    if xp is np:
        from .activations import swiglu_packed  # the reference of the SwiGLU half

        h = swiglu_packed(gu)
        s = ref_scale(history[:1].view(np.float32)[0], fmt, margin)
        si[...] = np.float32(1.0) / s
        q[...] = ref_cast(h, s, fmt)
        qt[...] = q.T
        history[0] = _as_bits(ref_amax(h))
        history[1:3] = 0
        return q, qt, si
    fm = _fmax_m(fmt, margin)
    if rows == 0:
        get_function(FAMILY, "fp8_scale")((1,), (32,), (history, fm, B.NULL, si))
        B.zero_(history[:3])
        return q, qt, si
    args = _scale_args(amax_src=history, fmax_m=fm, scale_inv=si, amax_out=L.ptr(history, 1), hist=history)
    vec = rows % 16 == 0 and F % 16 == 0 and B.aligned16(gu, q, qt)
    k = get_function(FAMILY, f"fp8_swiglu_cast_t_bf16_{B.DTYPE_TAG[fmt]}_{'v' if vec else 's'}")
    k((_tile_grid(k, rows, F),), (THREADS,), (gu, q, qt, np.int32(rows), np.int32(F), *args))
    return q, qt, si


@B.interop
def fp8_dequantize(q, scale_inv, *, q_dtype=None, dtype=np.float32, out=None):
    """``y = float(q) * scale_inv``: FP8 values back to float32 or bfloat16 (exact before the multiply; rounded once).

    Args:
        q: FP8 data: uint8 bits (``q_dtype`` names the format) or a NumPy float8 array; C-contiguous.
        scale_inv: a number or a 0-d float32 array (the inverse of the cast's scale).
        q_dtype: ``ck.float8_e4m3fn`` or ``ck.float8_e5m2`` (required for uint8 bits).
        dtype: float32 (default) or bfloat16.
        out: optional output of ``q.shape`` and ``dtype``.

    Returns:
        the dequantised array.

    Example::

        >>> xq, sx = ck.fp8_quantize(x)
        >>> x_back = ck.fp8_dequantize(xq, sx, q_dtype=ck.float8_e4m3fn)
    """
    xp = B.array_module(q=q, scale_inv=scale_inv if B._kind(scale_inv) is not None else None, out=out)
    bits, fmt = fp8_operand("q", q, q_dtype, "q_dtype")
    B.check_contiguous("q", bits)
    d = B.check_dtype_arg("dtype", dtype)
    if B._kind(scale_inv) is not None:
        _scalar_f32("scale_inv", scale_inv)
    else:
        B.check_f32("scale_inv", scale_inv, min=0)
    y = B.empty(xp, bits.shape, d, out)
    if xp is np:
        with np.errstate(invalid="ignore", over="ignore"):
            y[...] = (bits.view(fmt).astype(np.float32) * np.float32(scale_inv)).astype(d)
        return y
    n = bits.size
    if n == 0:
        return y
    dev = B._kind(scale_inv) is not None
    vec = n >= 16 and B.aligned16(bits, y)
    k = get_function(FAMILY, f"fp8_dequant_{B.DTYPE_TAG[fmt]}_{B.DTYPE_TAG[d]}_{'v' if vec else 's'}")
    units = n // 16 + n % 16 if vec else n
    k((_grid(k, units),), (THREADS,),
      (bits, y, np.int64(n), scale_inv if dev else B.NULL, np.float32(0.0 if dev else scale_inv)))
    return y


@B.interop
def fp8_transpose(q, *, out=None):
    """``q.T`` of a 2-D array of FP8 codes, C-contiguous: the operand layout cuBLASLt's FP8 GEMMs need for the other
    product (``ck.Fp8Shadow`` keeps a weight's ``q^T`` for the input gradient this way: 2 bytes an element, where
    a cast with the transpose from bf16 moves 4). The bytes move unchanged, whatever the format.

    Args:
        q: 2-D uint8 bits or a NumPy float8 array, C-contiguous.
        out: optional output of shape ``q.shape[::-1]`` and q's dtype.

    Returns:
        the transposed copy.

    Example::

        >>> wq, sw = ck.fp8_quantize(w)
        >>> wqt = ck.fp8_transpose(wq)            # == ck.fp8_quantize(w, transpose=True)[1]
    """
    xp = B.array_module(q=q, out=out)
    B.check_array("q", q)
    if q.dtype != UINT8 and q.dtype not in B.FP8:
        raise TypeError(f"q: expected FP8 data (uint8 bits or a NumPy float8 array); got dtype {q.dtype}")
    if q.ndim != 2:
        raise ValueError(f"q: expected a 2-D (rows, cols) array; got shape {tuple(q.shape)}")
    B.check_contiguous("q", q)
    rows, cols = (int(d) for d in q.shape)
    if rows >= 2**31 or cols >= 2**31:
        raise ValueError(f"q: at most 2**31 - 1 rows and columns; got shape {tuple(q.shape)}")
    qt = B.empty(xp, (cols, rows), q.dtype, out)
    if xp is np:
        qt[...] = q.T
        return qt
    if q.size == 0:
        return qt
    vec = rows % 16 == 0 and cols % 16 == 0 and B.aligned16(q, qt)
    k = get_function(FAMILY, f"fp8_transpose_{'v' if vec else 's'}")
    k((_tile_grid(k, rows, cols),), (THREADS,), (q, qt, np.int32(rows), np.int32(cols)))
    return qt


# ---------------------------------------------------------------------------------------------- amax hand-off
# A kernel that writes a tensor an FP8 linear will cast under current scaling can take max |t| in the same pass
# (``ck.add_rms_norm_backward(..., amax=)``: its dx is the output gradient of the o_proj / down projection before
# it). The producer notes ``(t, amax)`` here; the consumer (functional/fp8.py's backward) takes the amax back for
# the very array it received -- identity, not equality: a sum or a copy in between is another array, and then
# it runs the amax pass as before. Why: 32 of the 48 fp8_amax passes a step at the LLaMA-1B shape (0.55 ms in
# all) read a dx that add_rms_norm's backward had just written. An entry holds its array, so its id cannot be
# reused while noted; it is removed when taken, and at most _AMAX_KEEP are kept (a noted array nobody takes,
# the oldest first, is let go). The tape never updates a non-leaf gradient in place (autograd.fast_add makes a
# new array), so a taken amax is that of the array's values.
_AMAX_KEEP = 4
_amax_notes: dict = {}


def note_amax(arr, amax):
    """Record that the 0-d float32 ``amax`` holds ``max |arr|`` (computed by the kernel that wrote ``arr``)."""
    _amax_notes.pop(id(arr), None)
    _amax_notes[id(arr)] = (arr, amax)
    while len(_amax_notes) > _AMAX_KEEP:
        del _amax_notes[next(iter(_amax_notes))]


def take_amax(arr):
    """The amax noted for this very array (``is``), or None; the note is removed either way."""
    hit = _amax_notes.pop(id(arr), None)
    return hit[1] if hit is not None and hit[0] is arr else None


__all__ = ["fp8_amax", "fp8_cast", "fp8_dequantize", "fp8_history", "fp8_quantize", "fp8_scale", "fp8_swiglu_quantize",
           "fp8_transpose"]
