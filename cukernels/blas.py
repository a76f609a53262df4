"""GEMMs on a cuBLAS handle of our own: graph-capturable, mixed precision, accumulate into fp32.

``ck.matmul(a, b, *, trans_a=False, trans_b=False, out=None, out_dtype=None, alpha=1.0, beta=0.0)``

Why not ``cupy.matmul``: CuPy 14's cuBLAS wrappers call ``setStream`` before every GEMM and that raises
while a stream is being captured, so a training step with GEMMs could not become one CUDA graph. Here the
cuBLAS entry points are called through ctypes on the same libcublas CuPy loaded, with our own handle per
device: its stream is set only when the current stream changes (outside capture, or to the capture stream at
its start), and right after it a fixed workspace (cublasSetStream resets the workspace to cuBLAS' own pool,
whose allocations capture cannot hold) — the contract cuBLAS documents for graph capture.

Mixed precision (cublasGemmEx): bf16 x bf16 -> fp32 output with fp32 accumulation and ``beta=1`` lets a weight
gradient accumulate straight into the fp32 gradient buffer (no bf16 output + cast + add); bf16 -> bf16 for
activations; fp32 -> fp32 (compute 32F, no TF32 unless ``allow_tf32``).

Row-major ``C[M, N] = op(A) @ op(B)`` is computed as the column-major product ``C^T = op(B)^T op(A)^T``, so
no transposes are materialised. Leading dimensions broadcast like ``numpy.matmul`` when they are equal, or
when one operand is 2-D (a weight shared by every batch entry: batch stride 0).

Row-strided operands and outputs: an array whose LAST axis is contiguous but whose rows lie further apart than
their length (a column slice ``buf[:, :V]`` of a wider buffer) goes to cuBLAS as it is, its row stride being
the leading dimension (lda / ldb / ldc), and batch axes that one stride walks become the strided-batch stride;
nothing is copied. Why: GPT-2's logits [8192, 50257] bf16 have 100514-byte rows, so cuBLAS can only use its
1-element-aligned kernels on them (``cutlass_75_tensorop_*_align1``: 15.6 ms of a 42.7 ms step on an H200 for
the three LM-head GEMMs); the same logits inside rows of 50304 elements (``empty_padded``) are 16-byte aligned
and keep V = 50257 columns. cuBLAS computes any M / N / K and any leading dimension >= the row length, at any
element-aligned address, picking a slower kernel where a pointer or leading dimension is not 16-byte aligned,
so the only layouts refused are those it cannot express: a last axis that is not contiguous (a transposed
view: pass the array itself with ``trans_a`` / ``trans_b``), negative or overlapping rows, strides that are
no multiple of the element size, batch axes that no single stride walks, and (for ``out``) batch entries that
overlap.

FP8 (``a``, ``b`` FP8 data: uint8 bits with ``a_dtype`` / ``b_dtype``, or NumPy float8 arrays): cuBLASLt on a
handle of our own (``blaslt.py``), ``out = alpha * (a_scale * a) @ (b_scale * b).T + beta * out`` with the scales
0-d float32 device arrays, fp32 accumulation, a bfloat16 or float32 output. Hopper runs FP8 only with both
operands K-major (cuBLASLt's "TN"), so ``trans_b=True`` (b is [N, K]) and ``trans_a=False`` are required; K and N
multiples of 16, rows 16-byte aligned. ``ck.fp8_quantize(..., transpose=True)`` makes the transposed copies a
product over the other axis needs.
"""
from __future__ import annotations

import ctypes
import functools
import numbers
import threading

import numpy as np

from . import _backend as B
from . import blaslt as _lt
from .ops.fp8 import fp8_operand as _fp8_operand

_CUDA_R = {np.dtype(np.float32): 0, np.dtype(np.float16): 2, B.bfloat16: 14}
_COMPUTE_32F, _COMPUTE_32F_FAST_TF32 = 68, 77
_GEMM_DEFAULT = -1
WORKSPACE_BYTES = 32 << 20  # cuBLAS recommends >= 32 MiB on Hopper


class BlasError(RuntimeError):
    pass


@functools.lru_cache(maxsize=1)
def _lib():
    lib = _lt.load_library("cublas", BlasError)
    vp, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
    lib.cublasSetStream_v2.argtypes = [vp, vp]
    lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
    lib.cublasSetMathMode.argtypes = [vp, i]
    lib.cublasSetSmCountTarget.argtypes = [vp, i]
    lib.cublasGemmEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
    lib.cublasGemmStridedBatchedEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, ll, vp, i, i, ll, vp, vp, i, i, ll,
                                               i, i, i]
    return lib


def _check(status, what):
    if status != 0:
        raise BlasError(f"{what} failed with cuBLAS status {status}")


class _Handle:
    """One cuBLAS handle + workspace per device; remembers the stream it is bound to."""

    def __init__(self):
        import cupy

        lib = _lib()
        h = ctypes.c_void_p()
        _check(lib.cublasCreate_v2(ctypes.byref(h)), "cublasCreate")
        self.h = h
        self.workspace = cupy.empty(WORKSPACE_BYTES, dtype=cupy.uint8)
        self.stream = None

    def bind(self):
        import cupy

        s = cupy.cuda.get_current_stream().ptr
        if s != self.stream:
            lib = _lib()
            _check(lib.cublasSetStream_v2(self.h, ctypes.c_void_p(s)), "cublasSetStream")
            _check(lib.cublasSetWorkspace_v2(self.h, ctypes.c_void_p(self.workspace.data.ptr), WORKSPACE_BYTES),
                   "cublasSetWorkspace")
            self.stream = s
        return self.h


_handles: dict[int, _Handle] = {}
_lock = threading.Lock()


def _handle():
    import cupy

    dev = cupy.cuda.Device().id
    h = _handles.get(dev)
    if h is None:
        with _lock:
            h = _handles.get(dev) or _Handle()
            _handles[dev] = h
    return h.bind()


def set_sm_count_target(n: int) -> int:
    """Ask cuBLAS (and our persistent kernels: ``_backend.sm_target``) to size the GEMMs queued from now on (on
    this device's handle) for ``n`` multiprocessors (0: all of them, the default); returns the previous target. Hopper's GEMM kernels are persistent: a grid of
    one block per SM holds every SM until the GEMM ends, so a collective queued beside it on another stream only
    starts between GEMMs. ZeroAdamW lowers the target while its reduce-scatters run under the backward. A
    captured graph keeps the kernels chosen at capture time."""
    n = B.check_int("n", n, min=0)
    _handle()
    import cupy

    h = _handles[cupy.cuda.Device().id]
    old = getattr(h, "sm_target", 0)
    if n != old:
        _check(_lib().cublasSetSmCountTarget(h.h, n), "cublasSetSmCountTarget")
        h.sm_target = n
    B.set_sm_target(n)  # our persistent kernels (sm_90 attention) size their grids by it too
    return old


_INT_MAX = 2**31 - 1  # cuBLAS takes m, n, k, the leading dimensions and the batch count as 32-bit ints
PAD_ELEMS = 64  # empty_padded's default row quantum: 128 B of bf16, 256 B of fp32 (nanoGPT pads V to 50304)


def _ptr(x) -> int:
    return x.data.ptr if B._kind(x) is not np else x.__array_interface__["data"][0]


def _layout(name, x):
    """``(ld, batch_stride)`` in elements of a GEMM operand / output ``x`` of shape ``(..., R, C)``.

    The last axis must be contiguous; the rows may lie ``ld >= C`` elements apart (a column slice of a wider
    buffer); the batch axes must be walked by one stride (any C-contiguous stack, or a slice of whole matrices).
    A single row takes ``ld = C`` (its stride is meaningless), an absent batch ``batch_stride = R * ld``.
    """
    s = x.itemsize
    R, C = x.shape[-2:]
    if x.size == 0:  # nothing is read or written (the GEMM is skipped): its strides mean nothing
        return max(1, C), R * max(1, C)
    st = x.strides
    if C > 1 and st[-1] != s:
        raise ValueError(
            f"{name}: the last axis must be contiguous (stride {s} bytes) for cuBLAS; got strides {st} for shape "
            f"{tuple(x.shape)} (a transposed view? pass the array it views with trans_a / trans_b instead; no "
            "silent copies are made)")
    if B._kind(x) is not np and _ptr(x) % s:
        raise ValueError(f"{name}: the data pointer is not aligned to the {s}-byte element size")
    if R <= 1:
        ld = max(1, C)
    else:
        if st[-2] < 0 or st[-2] % s:
            raise ValueError(f"{name}: the row stride must be a non-negative multiple of the {s}-byte element "
                             f"size; got strides {st} for shape {tuple(x.shape)}")
        ld = st[-2] // s
        if ld < max(1, C):
            raise ValueError(f"{name}: rows overlap (row stride {ld} elements < row length {C}); got strides {st} "
                             f"for shape {tuple(x.shape)}")
    if ld > _INT_MAX:
        raise ValueError(f"{name}: row stride {ld} elements exceeds cuBLAS' 32-bit leading dimension")
    dims = [(n, t) for n, t in zip(x.shape[:-2], st[:-2]) if n > 1]
    if not dims:
        return ld, R * ld
    for n, t in dims:
        if t < 0 or t % s:
            raise ValueError(f"{name}: batch strides must be non-negative multiples of the {s}-byte element size; "
                             f"got strides {st} for shape {tuple(x.shape)}")
    for (n0, t0), (n1, t1) in zip(dims, dims[1:]):
        if t0 != n1 * t1:
            raise ValueError(f"{name}: the batch axes are not walked by one stride (strides {st} for shape "
                             f"{tuple(x.shape)}); cuBLAS' strided batch needs a C-ordered stack of matrices")
    return ld, dims[-1][1] // s


def _check_out_layout(out, M, N, nbatch):
    """``out``'s (ldc, batch stride), refusing batch entries that share elements (cuBLAS would race on them)."""
    ldc, sc = _layout("out", out)
    if nbatch > 1:
        disjoint = sc >= (M - 1) * ldc + N          # whole matrices one after the other
        interleaved = sc >= N and (nbatch - 1) * sc + N <= ldc  # row i of every entry side by side ([M, B, N] view)
        if not (disjoint or interleaved):
            raise ValueError(f"out: batch entries overlap (batch stride {sc}, row stride {ldc} elements for "
                             f"{M}x{N} matrices); got strides {out.strides} for shape {tuple(out.shape)}")
    return ldc, sc


@B.interop
def _check_out(out, odt, shape, M, N, nbatch):
    """``out`` of a product into it: required (beta != 0 accumulates into it), of dtype ``odt`` and ``shape``,
    writable, a layout cuBLAS can write; returns its (leading dimension, batch stride)."""
    if out is None:
        raise ValueError("out: required when beta != 0 (the product is accumulated into it)")
    B.check_dtype("out", out, (odt,))
    B.check_shape("out", out, shape)
    B.check_writable("out", out)
    return _check_out_layout(out, M, N, nbatch)


def _batch_shape(ashape, bshape, M, N, K):
    """``(batch, batch count, output shape)`` of a product of operands with these shapes (batch axes equal, or one
    operand 2-D: broadcast); ValueError when they disagree or a size exceeds cuBLAS' 32-bit ints."""
    ba, bb = tuple(ashape[:-2]), tuple(bshape[:-2])
    if ba and bb and ba != bb:
        raise ValueError(f"b: batch dimensions {bb} do not match a's {ba} (equal, or one operand 2-D)")
    batch = ba or bb
    nbatch = int(np.prod(batch)) if batch else 1
    for what, v in (("M", M), ("N", N), ("K", K), ("the batch count", nbatch)):
        if v > _INT_MAX:
            raise ValueError(f"a, b: {what} = {v} exceeds cuBLAS' 32-bit sizes")
    return batch, nbatch, (*batch, M, N)


def layout_ok(x) -> bool:
    """True when :func:`matmul` takes ``x`` (an operand or ``out``) as it is: last axis contiguous, rows at a
    non-negative element-multiple stride no shorter than a row, batch axes walked by one stride. A caller that
    would otherwise copy (``ascontiguousarray``) can test this first and pass row-strided views straight on.
    Arrays of fewer than 2 dimensions: False (matmul takes matrices)."""
    if getattr(x, "ndim", 0) < 2:
        return False
    try:
        _layout("x", x)
    except ValueError:
        return False
    return True


@B.interop
def empty_padded(shape, dtype, *, xp=None, multiple=PAD_ELEMS):
    """An uninitialised array of ``shape`` whose rows are ``ceil(shape[-1] / multiple) * multiple`` elements apart.

    The view ``buf[..., :shape[-1]]`` of a C-contiguous ``buf`` with the padded last axis: the layout the GEMMs
    and the cross-entropy kernels take without copying, and, with ``multiple * itemsize`` a multiple of 16 bytes,
    the one that keeps cuBLAS on its 16-byte-aligned (Hopper TMA) kernels whatever the row length. The padding
    columns are never read or written by those ops.

    Args:
        shape: the logical shape (at least 1-D).
        dtype: any NumPy / CuPy dtype.
        xp: ``cupy`` (default) or ``numpy``.
        multiple: row quantum in elements (positive int; default 64: 128 B of bf16).

    Example::

        >>> logits = ck.blas.empty_padded((8192, 50257), ck.bfloat16)   # rows 50304 apart
        >>> ck.matmul(x, w, trans_b=True, out=logits)                    # ldc = 50304
    """
    if xp is None:
        import cupy as xp
    multiple = B.check_int("multiple", multiple, min=1)
    if isinstance(shape, numbers.Integral):
        shape = (shape,)
    shape = tuple(B.check_int("shape", n, min=0) for n in shape)
    if not shape:
        raise ValueError("shape: expected at least one dimension")
    C = shape[-1]
    Cp = -(-C // multiple) * multiple
    return xp.empty((*shape[:-1], Cp), dtype=dtype)[..., :C]


@B.interop
def matmul(a, b, *, trans_a=False, trans_b=False, out=None, out_dtype=None, alpha=1.0, beta=0.0,
           allow_tf32=False, a_scale=None, b_scale=None, a_dtype=None, b_dtype=None, fast_accum=False):
    """``out = alpha * op(a) @ op(b) + beta * out`` with ``op(x) = x.T`` (last two axes) when asked.

    Args:
        a: ``(..., M, K)`` (``(..., K, M)`` with ``trans_a``), float32 or bfloat16; the last axis contiguous,
            rows any stride >= their length apart (``buf[:, :K]`` of a wider buffer: lda = the row stride).
        b: ``(..., K, N)`` (``(..., N, K)`` with ``trans_b``), same dtype and layout rules as ``a``; a 2-D ``b``
            (or ``a``) is shared by every batch entry.
        out: optional ``(..., M, N)`` output, row-strided like the operands (ldc = its row stride; the columns
            past N of a wider buffer are never touched); required when ``beta != 0`` (it is accumulated into).
        out_dtype: float32 or bfloat16 (default: ``out.dtype`` or ``a.dtype``); bf16 inputs with an fp32
            output accumulate and store in fp32.
        alpha, beta: finite host numbers (captured by value in a CUDA graph).
        allow_tf32: fp32 inputs use TF32 tensor cores (faster, ~1e-3 relative error).
        a_scale, b_scale: FP8 operands only: 0-d float32 arrays (device scalars on the GPU; None: 1) that turn the
            FP8 values into real ones, ``a ~ a_scale * a_fp8`` (``ck.fp8_quantize``'s ``scale_inv``).
        a_dtype, b_dtype: the FP8 format of a uint8 operand, ``ck.float8_e4m3fn`` or ``ck.float8_e5m2`` (taken
            from the dtype of a NumPy float8 array). cuBLASLt multiplies e4m3 x e4m3, e4m3 x e5m2 and e5m2 x e4m3.
            FP8 operands need ``trans_b=True`` (b is ``(..., N, K)``), ``trans_a=False``, K and N multiples of 16,
            16-byte aligned rows; the output is bfloat16 (default) or float32.
        fast_accum: FP8 only: cuBLASLt's fast accumulation (fewer promotions of the partial sums to fp32).

    Returns:
        ``out`` (a new C-contiguous array when not given). On NumPy arrays: the same product computed in float32
        (float64 when inputs are float64), with the same layout checks.

    Example::

        >>> dw = cp.zeros((out_f, in_f), cp.float32)
        >>> ck.matmul(dy_bf16, x_bf16, trans_a=True, out=dw, beta=1.0)   # dw += dy^T @ x, fp32 accumulate
        >>> z = ck.blas.empty_padded((N, 50257), ck.bfloat16)             # rows 50304 apart
        >>> ck.matmul(h, wte, trans_b=True, out=z)                         # logits, ldc = 50304
        >>> xq, sx = ck.fp8_quantize(x); wq, sw = ck.fp8_quantize(w)     # FP8: e4m3 bits + device scales
        >>> y = ck.matmul(xq, wq, trans_b=True, a_scale=sx, b_scale=sw, a_dtype=ck.float8_e4m3fn,
        ...               b_dtype=ck.float8_e4m3fn, out_dtype=ck.bfloat16)
    """
    fast_accum = B.check_bool("fast_accum", fast_accum)
    if _is_fp8(a, b, a_scale, b_scale, a_dtype, b_dtype):
        return _matmul_fp8(a, b, trans_a, trans_b, out, out_dtype, alpha, beta, allow_tf32, a_scale, b_scale,
                           a_dtype, b_dtype, fast_accum)
    if fast_accum:
        raise ValueError("fast_accum: applies to FP8 operands only (a and b here are not FP8 data)")
    xp = B.array_module(a=a, b=b, out=out)
    trans_a = B.check_bool("trans_a", trans_a)
    trans_b = B.check_bool("trans_b", trans_b)
    allow_tf32 = B.check_bool("allow_tf32", allow_tf32)
    alpha = B.check_real("alpha", alpha)
    beta = B.check_real("beta", beta)
    allowed = B.FLOATS + ((np.dtype(np.float64),) if xp is np else ())
    B.check_dtype("a", a, allowed)
    B.check_dtype("b", b, (a.dtype,))
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"a, b: expected at least 2 dimensions; got shapes {a.shape} and {b.shape}")
    lda, sa = _layout("a", a)
    ldb, sb = _layout("b", b)
    M, K = (a.shape[-1], a.shape[-2]) if trans_a else a.shape[-2:]
    Kb, N = (b.shape[-1], b.shape[-2]) if trans_b else b.shape[-2:]
    if K != Kb:
        raise ValueError(f"b: inner dimensions disagree: op(a) is {M}x{K} but op(b) is {Kb}x{N}")
    batch, nbatch, shape = _batch_shape(a.shape, b.shape, M, N, K)
    if out_dtype is not None:
        odt = B.check_dtype_arg("out_dtype", out_dtype, allowed)
    else:
        odt = out.dtype if out is not None else a.dtype
    if out is not None or beta != 0:
        ldc, sc = _check_out(out, odt, shape, M, N, nbatch)
    if xp is np:
        ct = np.float64 if a.dtype == np.float64 else np.float32
        opa = np.swapaxes(a, -1, -2) if trans_a else a
        opb = np.swapaxes(b, -1, -2) if trans_b else b
        r = alpha * np.matmul(opa.astype(ct), opb.astype(ct))
        if beta != 0:
            r = r + beta * out.astype(ct)
        if out is None:
            return r.astype(odt)
        out[...] = r.astype(odt)
        return out
    if odt not in _CUDA_R:
        raise TypeError(f"out_dtype: expected float32 or bfloat16; got {odt}")
    if a.dtype == np.float32 and odt != np.float32:
        raise TypeError(f"out_dtype: float32 inputs give a float32 output; got {odt}")
    if out is None:
        out = xp.empty(shape, dtype=odt)
        ldc, sc = max(1, N), M * N
    if out.size == 0:
        return out
    if K == 0:
        if beta == 0:
            if out.flags.c_contiguous:
                B.zero_(out)
            else:
                out.fill(0)  # a strided view: an elementwise kernel over its M x N elements only
        elif beta != 1:
            out *= beta
        return out
    lib = _lib()
    h = _handle()
    compute = _COMPUTE_32F_FAST_TF32 if (allow_tf32 and a.dtype == np.float32) else _COMPUTE_32F
    al, be = ctypes.c_float(alpha), ctypes.c_float(beta)
    ta, tb = int(bool(trans_a)), int(bool(trans_b))
    at, ot = _CUDA_R[a.dtype], _CUDA_R[odt]
    args_b = (ctypes.c_void_p(b.data.ptr), at, ldb)
    args_a = (ctypes.c_void_p(a.data.ptr), at, lda)
    if nbatch == 1:
        _check(lib.cublasGemmEx(h, tb, ta, N, M, K, ctypes.byref(al), *args_b, *args_a, ctypes.byref(be),
                                ctypes.c_void_p(out.data.ptr), ot, ldc, compute, _GEMM_DEFAULT), "cublasGemmEx")
    else:
        sa = sa if a.ndim > 2 else 0  # a 2-D operand is shared by every batch entry
        sb = sb if b.ndim > 2 else 0
        _check(lib.cublasGemmStridedBatchedEx(h, tb, ta, N, M, K, ctypes.byref(al), *args_b, sb, *args_a, sa,
                                              ctypes.byref(be), ctypes.c_void_p(out.data.ptr), ot, ldc, sc,
                                              nbatch, compute, _GEMM_DEFAULT), "cublasGemmStridedBatchedEx")
    return out


# ================================================================================================== FP8
_U8 = np.dtype(np.uint8)


def _is_fp8(a, b, *fp8_args) -> bool:
    """FP8 operands (uint8 bits or NumPy float8 arrays) or any FP8-only argument given: the cuBLASLt path, whose
    validation then names what does not fit."""
    if any(v is not None for v in fp8_args):
        return True
    return any(getattr(x, "dtype", None) in B.FP8 + (_U8,) for x in (a, b))


def _fp8_scale_arg(name, s):
    if s is None:
        return None
    if B._kind(s) is None:
        raise TypeError(f"{name}: expected a 0-d float32 array (cuBLASLt reads the scale from device memory: make "
                        f"it once with cupy.asarray(value, cupy.float32)) or None; got {B._got(s)}")
    B.check_dtype(name, s, (np.float32,))
    if s.ndim != 0:
        raise ValueError(f"{name}: expected a 0-d float32 array; got shape {tuple(s.shape)}")
    return s


def _matmul_fp8(a, b, trans_a, trans_b, out, out_dtype, alpha, beta, allow_tf32, a_scale, b_scale, a_dtype,
                b_dtype, fast_accum):
    xp = B.array_module(a=a, b=b, out=out, a_scale=a_scale if B._kind(a_scale) is not None else None,
                        b_scale=b_scale if B._kind(b_scale) is not None else None)
    trans_a = B.check_bool("trans_a", trans_a)
    trans_b = B.check_bool("trans_b", trans_b)
    B.check_bool("allow_tf32", allow_tf32)
    alpha = B.check_real("alpha", alpha)
    beta = B.check_real("beta", beta)
    a8, fa = _fp8_operand("a", a, a_dtype)
    b8, fb = _fp8_operand("b", b, b_dtype)
    if fa == fb == B.float8_e5m2:
        raise TypeError("b_dtype: cuBLASLt has no e5m2 x e5m2 GEMM (e4m3 x e4m3, e4m3 x e5m2 and e5m2 x e4m3 "
                        "only); cast one operand to ck.float8_e4m3fn")
    a_scale = _fp8_scale_arg("a_scale", a_scale)
    b_scale = _fp8_scale_arg("b_scale", b_scale)
    if trans_a or not trans_b:
        raise ValueError(f"trans_b: FP8 GEMMs take both operands K-major, a (..., M, K) and b (..., N, K) with "
                         f"trans_a=False, trans_b=True (cuBLASLt's only FP8 layout on Hopper); got trans_a={trans_a}, "
                         f"trans_b={trans_b} (make the transposed copy with ck.fp8_quantize(..., transpose=True))")
    if a8.ndim < 2 or b8.ndim < 2:
        raise ValueError(f"a, b: expected at least 2 dimensions; got shapes {a8.shape} and {b8.shape}")
    lda, sa = _layout("a", a8)
    ldb, sb = _layout("b", b8)
    M, K = a8.shape[-2:]
    N, Kb = b8.shape[-2:]
    if K != Kb:
        raise ValueError(f"b: inner dimensions disagree: a is {M}x{K} but b (N x K, trans_b) is {N}x{Kb}")
    if K % 16 or N % 16:
        raise ValueError(f"a, b: FP8 GEMMs need K and N multiples of 16; got M={M}, N={N}, K={K} (pad the "
                         "features, or run this GEMM in bf16)")
    for name, ld, st in (("a", lda, sa), ("b", ldb, sb)):
        if ld % 16 or st % 16:
            raise ValueError(f"{name}: FP8 rows must start 16 bytes apart (row stride {ld}, batch stride {st} "
                             "bytes): a C-contiguous array with K a multiple of 16 is")
    batch, nbatch, shape = _batch_shape(a8.shape, b8.shape, M, N, K)
    odt = (B.check_dtype_arg("out_dtype", out_dtype) if out_dtype is not None
           else out.dtype if out is not None else B.bfloat16)
    if out is not None or beta != 0:
        ldc, sc = _check_out(out, odt, shape, M, N, nbatch)
        if (ldc * out.itemsize) % 16 or (nbatch > 1 and (sc * out.itemsize) % 16):
            raise ValueError(f"out: FP8 GEMM output rows must start 16 bytes apart; got strides {out.strides}")
    if xp is np:
        af = a8.view(fa).astype(np.float64) * (1.0 if a_scale is None else float(a_scale))
        bf = b8.view(fb).astype(np.float64) * (1.0 if b_scale is None else float(b_scale))
        r = alpha * np.matmul(af, np.swapaxes(bf, -1, -2))
        if beta != 0:
            r = r + beta * out.astype(np.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            if out is None:
                return r.astype(odt)
            out[...] = r.astype(odt)
        return out
    _lt.check_device()
    for name, x in (("a", a8), ("b", b8), ("out", out)):
        if x is not None and x.size and x.data.ptr % 16:
            raise ValueError(f"{name}: FP8 GEMM operands must be 16-byte aligned; got a pointer {x.data.ptr % 16} "
                             "bytes past a 16-byte boundary")
    if out is None:
        out = xp.empty(shape, dtype=odt)
        ldc, sc = max(1, N), M * N
    if out.size == 0:
        return out
    if K == 0:
        if beta == 0:
            B.zero_(out) if out.flags.c_contiguous else out.fill(0)
        elif beta != 1:
            out *= beta
        return out
    return _lt.gemm_fp8(a8, b8, out, a_fmt=fa, b_fmt=fb, a_scale=a_scale, b_scale=b_scale, M=M, N=N, K=K, lda=lda,
                        ldb=ldb, ldc=ldc, sa=sa if a8.ndim > 2 else 0, sb=sb if b8.ndim > 2 else 0, sc=sc, nbatch=nbatch, alpha=alpha,
                        beta=beta, fast_accum=fast_accum)
